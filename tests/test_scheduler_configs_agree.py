"""Greedy output does not depend on how the scheduler cuts the work.

One workload (prompts of 3 to ~300 tokens, some sharing long prefixes, sent concurrently)
runs through real servers on a random-weight LLaMA in float32 under each scheduler
configuration; every run must produce the same tokens as the unconstrained one. All
servers run with --check-seq-lens, so a mirror drift fails the run.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.helpers import Server, make_random_llama, running_server, serve_greedy, wait_until

MAX_NEW = 20


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_random_llama(str(tmp_path_factory.mktemp("tiny_llama")), seed=1)


def workload() -> list[list[int]]:
    rng = np.random.default_rng(0)
    shared = rng.integers(100, 20000, 120).tolist()
    prompts = [rng.integers(100, 20000, n).tolist() for n in (3, 17, 64, 150, 301)]
    prompts += [shared + rng.integers(100, 20000, n).tolist() for n in (1, 9, 40)]
    prompts += [prompts[3][:100] + [7, 8, 9], prompts[4]]  # a partial prefix and an exact repeat
    return prompts


def server_args(model: str, *extra: str) -> list[str]:
    return ["--model", model, "--dtype", "float32", "--check-seq-lens", *extra]


def serve_workload(
    extra_args: list[str], model: str, prompts: list[list[int]] | None = None, max_new: int = MAX_NEW
) -> tuple[list[list[int]], dict]:
    with running_server(server_args(model, *extra_args)) as server:
        return serve_greedy(server, prompts or workload(), max_new)


@pytest.fixture(scope="module")
def references(tiny_model) -> dict[str, list[list[int]]]:
    """Both workloads on one plain server (no overlap, no prefix cache, a pool that never fills)."""
    flags = ["--max-total-tokens", "65536", "--disable-overlap", "--disable-radix-cache"]
    with running_server(server_args(tiny_model, *flags)) as server:
        outputs, _ = serve_greedy(server, workload(), MAX_NEW)
        retraction_outputs, stats = serve_greedy(server, retraction_workload(), RETRACTION_NEW)
    assert all(len(o) == MAX_NEW for o in outputs)
    assert stats["retractions"] == 0
    return {"workload": outputs, "retraction": retraction_outputs}


@pytest.fixture(scope="module")
def reference(references) -> list[list[int]]:
    return references["workload"]


@pytest.fixture(scope="module")
def cache_on_server(tiny_model):
    """Shared by the config test and the prefix-cache test: each counts only its own work."""
    with running_server(server_args(tiny_model, "--max-total-tokens", "65536")) as server:
        yield server


@pytest.fixture(scope="module")
def cache_off_server(tiny_model):
    with running_server(server_args(tiny_model, "--max-total-tokens", "65536", "--disable-radix-cache")) as server:
        yield server


SHARED_SERVERS = {"radix_cache_on_overlap_on": "cache_on_server", "radix_cache_off": "cache_off_server"}


CONFIGS = {
    "radix_cache_on_overlap_on": [],
    "radix_cache_off": ["--disable-radix-cache"],
    "chunk_of_7_tokens": ["--chunked-prefill-size", "7", "--max-prefill-tokens", "20"],
    "page_size_16": ["--page-size", "16"],
    "page_size_16_chunk_of_one_page": ["--page-size", "16", "--chunked-prefill-size", "16"],
    "longest_prefix_first": ["--schedule-policy", "lpm"],
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_output_is_identical_under_scheduler_config(name, tiny_model, reference, request):
    if name in SHARED_SERVERS:
        outputs, _ = serve_greedy(request.getfixturevalue(SHARED_SERVERS[name]), workload(), MAX_NEW)
    else:
        outputs, _ = serve_workload(["--max-total-tokens", "65536", *CONFIGS[name]], tiny_model)
    assert outputs == reference


def retraction_workload() -> list[list[int]]:
    """16 prompts of 40 tokens that each grow by 40: 1,280 tokens of demand on a 700-token
    pool. Admission keeps one page per running decode in reserve, and each request needs ten
    more while it decodes, so whenever more than ~9 run together some must be retracted."""
    rng = np.random.default_rng(5)
    return [rng.integers(100, 20000, 40).tolist() for _ in range(16)]


RETRACTION_NEW = 40


@pytest.fixture(scope="module")
def retraction_reference(references) -> list[list[int]]:
    return references["retraction"]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
def test_greedy_output_is_identical_under_retraction_from_a_tiny_kv_pool(overlap, tiny_model, retraction_reference):
    flags = ["--max-total-tokens", "700", "--page-size", "4"] + ([] if overlap else ["--disable-overlap"])
    outputs, stats = serve_workload(flags, tiny_model, retraction_workload(), RETRACTION_NEW)
    assert stats["retractions"] > 0
    assert outputs == retraction_reference


def test_shared_system_prompt_cuts_prefill_work_tenfold(cache_on_server, cache_off_server):
    rng = np.random.default_rng(3)
    system = rng.integers(100, 20000, 200).tolist()
    prompts = [system + rng.integers(100, 20000, 4).tolist() for _ in range(16)]

    def computed_prefill(server: Server) -> int:
        http = server.http()
        before = server.scheduler_stats()
        body = {"sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
        assert http.post("/generate", json={"input_ids": prompts[0], **body}).status_code == 200
        with ThreadPoolExecutor(15) as pool:
            codes = list(
                pool.map(lambda p: http.post("/generate", json={"input_ids": p, **body}).status_code, prompts[1:])
            )
        assert codes == [200] * 15
        # Stats are published periodically: wait for the frame that counts every token.
        target = before["generation_tokens"] + 16 * 4
        assert wait_until(lambda: server.scheduler_stats()["generation_tokens"] == target, 10)
        return server.scheduler_stats()["prefill_tokens_computed"] - before["prefill_tokens_computed"]

    with_cache = computed_prefill(cache_on_server)
    without_cache = computed_prefill(cache_off_server)
    assert without_cache == 16 * 204
    assert without_cache >= 10 * with_cache, (with_cache, without_cache)
