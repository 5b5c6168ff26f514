"""Drive a worker alone through a recorded descriptor stream: `python -m gpu_worker.sim.replay FILE`.

The recording (`launch.py --record-batches FILE`) holds every frame the scheduler sent and
every result it received. Replay feeds the same descriptors to a freshly loaded worker in
this process, checks that it samples the same tokens, and times it: with no scheduler,
no sockets and no waiting, the replayed throughput is the model-only limit for that
workload, and served ÷ replayed is the engine's efficiency. `gpu_worker.sim.fit_profile` times
the same replay step by step to fit a simulated worker's profile.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec
import numpy as np
from tqdm import tqdm

from gpu_worker.runtime.malloc_policy import keep_freed_memory
from gpu_worker.runtime.omp_policy import use_passive_omp_wait
from trident.wire.backend import BatchDescriptor, ResetBatch, StepResult, WorkerError, WorkerInput
from trident.wire.child import ChildContext
from trident.wire.codec import unpack_int32
from trident.wire.recording import RECEIVED, SENT, read_recording
from trident.wire.server_args import ServerArgs


@dataclass
class Recording:
    args: ServerArgs
    sent: list[WorkerInput] = field(default_factory=list)
    results: dict[int, StepResult] = field(default_factory=dict)
    """Recorded results by step id."""
    result_times: dict[int, float] = field(default_factory=dict)
    """When each result arrived, in seconds since the recording started."""


def load_recording(path: str) -> Recording:
    """Raises OSError or ValueError for a file that is not a readable recording."""
    args, records = read_recording(path)
    rec = Recording(args)
    decoder = msgspec.msgpack.Decoder(WorkerInput)
    result_decoder = msgspec.msgpack.Decoder(StepResult)
    for kind, t, frame in records:
        if kind == SENT:
            rec.sent.append(decoder.decode(frame))
        elif kind == RECEIVED:
            r = result_decoder.decode(frame)
            rec.results[r.step_id] = r
            rec.result_times[r.step_id] = t
    return rec


def replay_worker(args: ServerArgs, **overrides):
    """A model worker in this process, for the recorded run's arguments.

    Plain loop, no debug copies: the worker's own cost for the same descriptors. One
    unsharded rank: a tensor-parallel recording replays on one process (same tokens, greedy).
    """
    from gpu_worker.runtime.worker import Worker

    run_dir = tempfile.mkdtemp(prefix="trident-replay-")
    args = msgspec.structs.replace(
        args, run_dir=run_dir, disable_overlap=True, check_seq_lens=False, tp_size=1, worker="model", **overrides
    )
    return Worker(ChildContext(args, "worker", 0))


def replay_steps(worker, sent: list[WorkerInput], desc: str = "replaying steps") -> Iterator[tuple[int, StepResult]]:
    """Runs every descriptor; yields (step id, result) with the worker's `last_step_features`
    and `step_started` describing that step. Raises RuntimeError if a step fails."""
    for msg in tqdm(sent, desc=desc, unit="step"):
        if isinstance(msg, ResetBatch):
            worker.state.reset(msg.next_step_id)
            worker.on_reset()
            continue
        assert isinstance(msg, BatchDescriptor)
        out = worker.step(msg)
        if isinstance(out, WorkerError):
            raise RuntimeError(f"step {msg.step_id} failed on replay: {out.error}")
        yield msg.step_id, out


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
    use_passive_omp_wait()  # as the served worker does, so that served / replayed compares like with like
    keep_freed_memory()
    logging.basicConfig(level="WARNING")

    try:
        rec = load_recording(ns.recording)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    overrides = {k: v for k, v in (("model_path", ns.model), ("device", ns.device), ("dtype", ns.dtype)) if v}
    worker = replay_worker(rec.args, **overrides)
    matched = mismatched = replayed_tokens = 0
    start = time.perf_counter()
    try:
        for step_id, out in replay_steps(worker, rec.sent):
            got = unpack_int32(out.next_token_ids)
            replayed_tokens += len(got)
            want = rec.results.get(step_id)
            if want is not None:
                if np.array_equal(got, unpack_int32(want.next_token_ids)):
                    matched += 1
                else:
                    mismatched += 1
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - start
    served_tokens, served_span = decode_tokens_served(rec.results, rec.result_times)
    served_tps = served_tokens / served_span if served_span else 0.0
    replay_tps = replayed_tokens / elapsed if elapsed else 0.0
    report = {
        "steps": len(rec.sent),
        "steps_matched": matched,
        "steps_mismatched": mismatched,
        "replay_seconds": elapsed,
        "replayed_tokens_per_s": replay_tps,
        "served_seconds": served_span,
        "served_tokens_per_s": served_tps,
        "engine_efficiency": served_tps / replay_tps if replay_tps else 0.0,
    }
    print(json.dumps(report, indent=2))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if mismatched == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
