"""Throughput cost of constrained decoding: 32 concurrent JSON-schema requests against the
same 32 unconstrained, in one run, overlap on, and the worker's per-step mask cost.

Each of `--concurrency` client threads sends `--requests-each` chat requests back to back,
first unconstrained, then with `response_format` json_schema, alternating for `--rounds`;
the score of a phase is completion tokens per second until its last request ends. Every request runs exactly
`MAX_TOKENS` tokens (`ignore_eos`; a constrained row whose JSON is complete may then only
emit EOS, still masked every step), so both phases have the same request lengths and
prefill load and differ only in the constraint's cost. The per-step part times
`GrammarTable.apply_masks` (fill every row's mask, apply it to the logits) in process.

    python benchmarks/bench_structured.py [--concurrency 32] [--requests-each 2] [--rounds 2]
    python benchmarks/bench_structured.py --worker-ab 3   # the worker alone, CPU ms per step
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.launched_server import LaunchedServer  # noqa: E402
from gpu_worker.runtime.grammar import GrammarTable  # noqa: E402
from tests.structured_schemas import SCHEMAS  # noqa: E402
from trident.model_source import default_model_path  # noqa: E402
from trident.wire.frontend import GrammarSpec  # noqa: E402

SCHEMA = SCHEMAS["array_of_objects"]
MAX_TOKENS = 48


def phase(base_url: str, concurrency: int, requests_each: int, constrained: bool) -> float:
    """Completion tokens per second of `concurrency` clients sending `requests_each` requests
    each, back to back, timed until the last one ends (a fixed amount of work: timing a
    fixed window would count only the requests that ended inside it)."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)
    tokens = [0] * concurrency
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}

    def run(i: int) -> None:
        for k in range(requests_each):
            seed = i * 1000 + k
            res = client.chat.completions.create(
                model="smollm2-135m",
                messages=[{"role": "user", "content": f"List the people of team {seed} as JSON."}],
                max_tokens=MAX_TOKENS,
                temperature=0.8,
                seed=seed,
                extra_body={"ignore_eos": True, **({"response_format": response_format} if constrained else {})},
            )
            tokens[i] += res.usage.completion_tokens

    t0 = time.monotonic()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(tokens) / (time.monotonic() - t0)


def worker_stats(base_url: str) -> tuple[float, int]:
    """(worker busy seconds, steps) so far, from the scheduler's statistics."""
    import httpx

    stats = httpx.get(base_url + "/server_info", timeout=30).json()["scheduler_stats"]
    return stats["worker_busy_s"], stats["steps"]


def mask_step_ms(rows: int, repeats: int = 50) -> float:
    """Milliseconds per step to fill and apply `rows` masks (each row mid-way through its JSON)."""
    table = GrammarTable(rows, 49152, default_model_path(), [2])
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    for slot in range(rows):
        table.add(slot, spec, [])
    logits = torch.randn(rows, 49152)
    slots = list(range(rows))
    table.apply_masks(logits, slots, slots)
    t0 = time.perf_counter()
    for _ in range(repeats):
        table.apply_masks(logits, slots, slots)
    return (time.perf_counter() - t0) / repeats * 1e3


def worker_ab(rounds: int, batch: int, steps: int) -> None:
    """The worker alone, in this process, one torch thread: process CPU ms per decode step of
    `batch` rows at temperature 0.8, unconstrained and json_schema, alternating `rounds`
    times. CPU time of one thread is far steadier than wall time on a shared host."""
    import statistics

    import msgspec

    from benchmarks.bench_worker_step import SyntheticScheduler, make_worker
    from trident.wire.backend import AddedRequest, ExtendChunk, ForwardMode, PageAppends
    from trident.wire.codec import pack_int32
    from trident.wire.frontend import SamplingParams

    class Requests(SyntheticScheduler):
        def __init__(self, worker, params: SamplingParams, seed: int) -> None:
            super().__init__(worker, batch, 32, steps + 1, seed)
            self.params = params

        def prefill(self) -> None:
            added = [AddedRequest(s, 0, self.params) for s in range(batch)]
            pages = PageAppends.of_rows(self._pages(s, len(p)) for s, p in enumerate(self.prompts))
            extends = [ExtendChunk(s, pack_int32(p), True) for s, p in enumerate(self.prompts)]
            self._send(ForwardMode.EXTEND, removed_slots=[], added=added, page_appends=pages, extends=extends)

    torch.set_num_threads(1)
    worker = make_worker(default_model_path(), "bfloat16", batch * (32 + steps + 8), batch)
    plain = SamplingParams(max_new_tokens=1 << 20, temperature=0.8, seed=1, ignore_eos=True)
    constrained = msgspec.structs.replace(plain, grammar=GrammarSpec("json_schema", json.dumps(SCHEMA)))
    for r in range(rounds):
        for name, params in (("unconstrained", plain), ("json_schema", constrained)):
            requests = Requests(worker, params, seed=r)
            requests.prefill()
            cpu = []
            for _ in range(steps):
                c0 = time.process_time()
                requests.decode()
                cpu.append(time.process_time() - c0)
            requests.finish()
            print(f"worker, {batch} rows, {name:>13}: {statistics.median(cpu) * 1e3:.1f} CPU ms/step", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests-each", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--server-args", default="--max-running-requests 32")
    ap.add_argument("--worker-ab", type=int, default=0, metavar="ROUNDS", help="only the in-process worker A/B")
    args = ap.parse_args()
    if args.worker_ab:
        worker_ab(args.worker_ab, args.concurrency, steps=24)
        return
    for rows in (1, args.concurrency):
        print(f"apply_masks, {rows} rows: {mask_step_ms(rows):.2f} ms/step", flush=True)
    log = os.path.join(tempfile.mkdtemp(), "server.log")
    with LaunchedServer(f"{sys.executable} launch.py {args.server_args}", log) as server:
        phase(server.base_url, 2, 1, True)  # warm up: the worker reads the vocabulary once
        results: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for constrained in (False, True):
                before = worker_stats(server.base_url)
                rate = phase(server.base_url, args.concurrency, args.requests_each, constrained)
                after = worker_stats(server.base_url)
                busy_ms = (after[0] - before[0]) / max(1, after[1] - before[1]) * 1e3
                results[constrained].append(rate)
                name = "json_schema" if constrained else "unconstrained"
                print(f"{name:>13}: {rate:.1f} tok/s, worker busy {busy_ms:.1f} ms/step", flush=True)
    plain, constrained = (sum(results[k]) / len(results[k]) for k in (False, True))
    ratio = constrained / plain
    print(f"constrained / unconstrained throughput: {ratio:.3f} ({(1 - ratio) * 100:.1f} % cost)")


if __name__ == "__main__":
    main()
