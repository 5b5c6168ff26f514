"""Drive a worker alone through a recorded descriptor stream: `python -m gpu_worker.replay FILE`.

The recording (`launch.py --record-batches FILE`) holds every frame the scheduler sent and
every result it received. Replay feeds the same descriptors to a freshly loaded worker in
this process, checks that it samples the same tokens, and times it: with no scheduler,
no sockets and no waiting, the replayed throughput is the model-only limit for that
workload, and served ÷ replayed is the engine's efficiency.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time

import msgspec
import numpy as np
from tqdm import tqdm

from wire.backend import BatchDescriptor, ResetBatch, StepResult, WorkerInput
from wire.child import ChildContext
from wire.codec import unpack_int32
from wire.recording import RECEIVED, SENT, read_recording


def decode_tokens_served(results: dict[int, StepResult], times: dict[int, float]) -> tuple[int, float]:
    """Tokens sampled by decoding rows, and the span of recorded time they took."""
    if not results:
        return 0, 0.0
    tokens = sum(len(unpack_int32(r.next_token_ids)) for r in results.values())
    span = max(times.values()) - min(times.values())
    return tokens, span


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recording")
    p.add_argument("--model", default=None, help="override the recorded model path")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--json", default=None, help="write the report here")
    ns = p.parse_args(argv)
    logging.basicConfig(level="WARNING")

    try:
        args, records = read_recording(ns.recording)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sent: list[WorkerInput] = []
    results: dict[int, StepResult] = {}
    result_times: dict[int, float] = {}
    decoder = msgspec.msgpack.Decoder(WorkerInput)
    result_decoder = msgspec.msgpack.Decoder(StepResult)
    for kind, t, frame in records:
        if kind == SENT:
            sent.append(decoder.decode(frame))
        elif kind == RECEIVED:
            r = result_decoder.decode(frame)
            results[r.step_id] = r
            result_times[r.step_id] = t

    overrides = {k: v for k, v in (("model_path", ns.model), ("device", ns.device), ("dtype", ns.dtype)) if v}
    # Plain loop, no debug copies: the worker's own cost for the same descriptors.
    run_dir = tempfile.mkdtemp(prefix="trident-replay-")
    # One unsharded rank: a tensor-parallel recording replays on one process (same tokens, greedy).
    args = msgspec.structs.replace(
        args, run_dir=run_dir, disable_overlap=True, check_seq_lens=False, tp_size=1, **overrides
    )
    from gpu_worker.worker import Worker

    worker = Worker(ChildContext(args, "worker", 0))
    matched = mismatched = replayed_tokens = 0
    start = time.perf_counter()
    for msg in tqdm(sent, desc="replaying steps", unit="step"):
        if isinstance(msg, ResetBatch):
            worker.state.reset(msg.next_step_id)
            continue
        assert isinstance(msg, BatchDescriptor)
        out = worker.step(msg)
        if not isinstance(out, StepResult):
            print(f"error: step {msg.step_id} failed on replay: {out.error}", file=sys.stderr)
            return 1
        got = unpack_int32(out.next_token_ids)
        replayed_tokens += len(got)
        want = results.get(msg.step_id)
        if want is not None:
            if np.array_equal(got, unpack_int32(want.next_token_ids)):
                matched += 1
            else:
                mismatched += 1
    elapsed = time.perf_counter() - start
    served_tokens, served_span = decode_tokens_served(results, result_times)
    served_tps = served_tokens / served_span if served_span else 0.0
    replay_tps = replayed_tokens / elapsed if elapsed else 0.0
    report = {
        "steps": len(sent), "steps_matched": matched, "steps_mismatched": mismatched,
        "replay_seconds": elapsed, "replayed_tokens_per_s": replay_tps,
        "served_seconds": served_span, "served_tokens_per_s": served_tps,
        "engine_efficiency": served_tps / replay_tps if replay_tps else 0.0,
    }
    print(json.dumps(report, indent=2))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if mismatched == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
