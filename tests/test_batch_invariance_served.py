"""Batch invariance, served: the real SmolLM2 in its default dtype (bf16) and weights (the
GGUF's own block formats, quant_linear.py) gives each prompt the same greedy tokens, token for
token, however it is served.

The reference is each prompt sent alone to a fresh server. Then, on that server: in random
crowds of other requests, again from the radix cache, and through a SIGKILL of the worker
and of the scheduler mid-stream (the resumed requests are prefilled again, prompt and
generated tokens as one chunk). On other servers: 16-token chunks with overlap off, 40-token
chunks with n-gram speculation, and (within tp 2) at tensor parallelism 2. Seeded sampled
output is the same alone and in a crowd. tests/test_batch_invariance_kernels.py shows the
checks' bitwise form failing on batch-dependent reductions.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import Server, running_server, smollm2_gguf
from tests.test_fast_path_vs_transformers import TEXT
from tests.test_faults import kill_scheduler, kill_worker
from tests.workload import run_with_fault

pytestmark = pytest.mark.timeout(900)

MAX_NEW = 32
BASE = ["--model", "smollm2-135m", "--max-total-tokens", "16384"]


def text_prompts() -> list[list[int]]:
    """Six prompts of real text, 6 to 120 tokens: random ids would leave the model near ties
    everywhere, which makes the check stricter than text but no more meaningful."""
    from tokenizer_proc.tokenization import load_tokenizer

    ids = load_tokenizer(smollm2_gguf()).encode(TEXT)
    return [ids[50 * i : 50 * i + n] for i, n in enumerate([6, 120, 17, 64, 33, 90])]


def generate(server: Server, ids: list[int], max_new: int = MAX_NEW, **sampling) -> list[int]:
    params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True, **sampling}
    with server.http() as http:
        r = http.post("/generate", json={"input_ids": ids, "sampling_params": params}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def alone(server: Server, prompts: list[list[int]], **sampling) -> list[list[int]]:
    return [generate(server, p, **sampling) for p in prompts]


def in_a_crowd(server: Server, prompts: list[list[int]], crowd: int, **sampling) -> list[list[int]]:
    """`prompts` sent at once among 16 other requests of 4-200 tokens asking 8-95 tokens, in a
    random order: each prompt shares its steps with others of other lengths and phases."""
    rng = random.Random(crowd)
    others = [
        ([rng.randrange(100, 20000) for _ in range(rng.randrange(4, 200))], rng.randrange(8, 96)) for _ in range(16)
    ]
    jobs = [("ours", i, p, MAX_NEW) for i, p in enumerate(prompts)] + [
        ("other", i, p, n) for i, (p, n) in enumerate(others)
    ]
    rng.shuffle(jobs)
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {
            (kind, i): pool.submit(generate, server, p, n, **(sampling if kind == "ours" else {}))
            for kind, i, p, n in jobs
        }
        return [futures["ours", i].result() for i in range(len(prompts))]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return text_prompts()


@pytest.fixture(scope="module")
def default_server():
    with running_server(BASE) as server:
        yield server


@pytest.fixture(scope="module")
def reference(default_server, prompts) -> list[list[int]]:
    """Each prompt alone on a fresh server (module order: before anything else uses it)."""
    return alone(default_server, prompts)


def test_the_default_server_serves_the_gguf_formats_batch_invariant(default_server):
    ready = next(line for line in default_server.output if "worker[tp0] ready" in line)
    assert "weights gguf" in ready and "batch invariant" in ready and "not batch invariant" not in ready, ready


def test_each_prompt_gets_the_same_tokens_in_random_crowds(default_server, prompts, reference):
    for crowd in (1, 2):
        assert in_a_crowd(default_server, prompts, crowd) == reference, f"crowd {crowd}"


def test_each_prompt_gets_the_same_tokens_from_the_radix_cache(default_server, prompts, reference):
    before = default_server.scheduler_stats()["prefill_tokens_computed"]
    assert alone(default_server, prompts) == reference
    prompt_tokens = sum(len(p) for p in prompts)
    assert default_server.scheduler_stats()["prefill_tokens_computed"] - before < prompt_tokens / 2, "cache hits"


def test_seeded_sampling_gives_the_same_tokens_alone_and_in_a_crowd(default_server, prompts):
    sampling = {"temperature": 0.9, "top_p": 0.95, "seed": 7}
    by_itself = alone(default_server, prompts, **sampling)
    assert in_a_crowd(default_server, prompts, 4, **sampling) == by_itself


@pytest.mark.parametrize("fault", [kill_worker, kill_scheduler], ids=["sigkill_worker", "sigkill_scheduler"])
def test_requests_resumed_after_a_sigkill_keep_their_tokens(default_server, prompts, reference, fault):
    before = default_server.counter("trident_restarts_total")
    assert run_with_fault(default_server, fault, prompts, MAX_NEW) == reference
    assert default_server.counter("trident_restarts_total") == before + 1


def test_16_token_chunks_without_overlap_keep_the_tokens(prompts, reference):
    with running_server([*BASE, "--chunked-prefill-size", "16", "--disable-overlap"]) as server:
        assert in_a_crowd(server, prompts, 5) == reference


def test_40_token_chunks_with_ngram_speculation_keep_the_tokens(prompts, reference):
    with running_server([*BASE, "--chunked-prefill-size", "40", "--speculative-algorithm", "ngram"]) as server:
        assert in_a_crowd(server, prompts, 6) == reference
        assert server.scheduler_stats()["spec_accepted_drafts"] > 0, "drafts were verified and accepted"


def test_tensor_parallel_2_is_batch_invariant_within_itself(prompts):
    """At tp 2 the row-parallel sums are split across ranks, so the bits differ from tp 1;
    among tp 2 runs, a prompt's tokens do not depend on its crowd or its chunking."""
    with running_server([*BASE, "--tp-size", "2", "--chunked-prefill-size", "24"]) as server:
        tp2_alone = alone(server, prompts[:3])
        assert in_a_crowd(server, prompts[:3], 8) == tp2_alone
