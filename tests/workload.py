"""The standard concurrent greedy workload of the fault, parallelism and multi-node tests.

Twelve requests of 4-60 random prompt tokens and 160 forced output tokens, sent at once;
`run_with_fault` applies a fault once generation is under way and returns every output, so
a test can compare them with an undisturbed run (the `fault_reference` fixture).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psutil

from tests.helpers import Server, wait_until

NUM_REQUESTS = 12
MAX_NEW = 160
BASE = ["--dtype", "float32", "--max-total-tokens", "16384"]
STATS_PERIOD_S = 0.6
"""The scheduler publishes its statistics every half second."""


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(100, 20000, int(n)).tolist() for n in rng.integers(4, 60, NUM_REQUESTS)]


def child(server: Server, title: str) -> psutil.Process:
    for p in server.process_tree()[1:]:
        if " ".join(p.cmdline()).strip() == title:
            return p
    raise AssertionError(f"no {title} process")


def generation_tokens(server: Server) -> int:
    """Tokens the tokenizer has handed to clients so far: its /metrics counter, live, where
    the scheduler's statistics lag by up to their period, longer than a short workload takes
    to finish (a fault meant to land mid-generation then landed after it). It restarts from 0
    with the tokenizer."""
    return int(server.counter("trident_generation_tokens_total"))


def run_with_fault(
    server: Server, fault, prompt_ids: list[list[int]] | None = None, max_new: int = MAX_NEW
) -> list[list[int]]:
    """Sends the workload (or `prompt_ids`) concurrently and applies `fault` once generation
    is under way (on a server shared between tests: under way in this run)."""
    http = server.http()
    before = generation_tokens(server) if fault is not None else 0
    params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}

    def one(ids: list[int]) -> list[int]:
        r = http.post("/generate", json={"input_ids": ids, "sampling_params": params}, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        futures = [pool.submit(one, p) for p in prompt_ids or prompts()]
        if fault is not None:
            assert wait_until(lambda: generation_tokens(server) > before + NUM_REQUESTS * 5, 60)
            fault(server)
        return [f.result() for f in futures]
