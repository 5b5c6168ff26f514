"""Overlap scheduling and speculative decoding change speed, never greedy output.

Every server here runs with --check-seq-lens, so the scheduler's mirror is asserted
against the worker's seq_lens at every step and every sync.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import numpy as np
import pytest

from tests.helpers import Server, make_random_llama, running_server, serve_greedy, wait_until

MAX_NEW = 24
OVERLAP = {"overlap_on": [], "overlap_off": ["--disable-overlap"]}
SPEC = {"spec_off": [], "spec_ngram": ["--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "4"]}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_random_llama(str(tmp_path_factory.mktemp("tiny_llama_spec")), seed=2, scale=0.1)


def repetitive_workload() -> list[list[int]]:
    """Prompts whose continuations repeat what they contain, so drafts get accepted."""
    rng = np.random.default_rng(5)
    phrase = rng.integers(100, 20000, 12).tolist()
    prompts = [phrase * 6, rng.integers(100, 20000, 40).tolist() * 3, rng.integers(100, 20000, 200).tolist()]
    prompts += [phrase * 2 + rng.integers(100, 20000, n).tolist() for n in (5, 60, 130)]
    return prompts


def retraction_workload() -> list[list[int]]:
    """Short prompts with long outputs: admitted together, they outgrow a small pool while decoding."""
    rng = np.random.default_rng(6)
    phrase = rng.integers(100, 20000, 6).tolist()
    return [phrase * 3 + rng.integers(100, 20000, n).tolist() for n in (2, 5, 9, 14, 20, 27)]


RETRACTION_NEW = 64


def server_args(model: str, *flags: str) -> list[str]:
    return ["--model", model, "--dtype", "float32", "--check-seq-lens", *flags]


def serve(model: str, flags: list[str], prompts: list[list[int]], max_new: int = MAX_NEW):
    with running_server(server_args(model, *flags)) as server:
        return serve_greedy(server, prompts, max_new)


@pytest.fixture(scope="module")
def references(tiny_model) -> dict[str, list[list[int]]]:
    """Both workloads on one plain server (no overlap, a pool that never fills)."""
    with running_server(server_args(tiny_model, "--disable-overlap", "--max-total-tokens", "65536")) as server:
        outputs, _ = serve_greedy(server, repetitive_workload(), MAX_NEW)
        retraction_outputs, _ = serve_greedy(server, retraction_workload(), RETRACTION_NEW)
    return {"repetitive": outputs, "retraction": retraction_outputs}


@pytest.fixture(scope="module")
def reference(references):
    return references["repetitive"]


@pytest.fixture(scope="module")
def retraction_reference(references):
    return references["retraction"]


# All prompts arrive together (continuous batching); 16-token chunks spread the long ones. At
# most 6 run at once: the repetitive workload's 6 all fit, the seq_lens test's 24 join and leave.
BATCHED_FLAGS = [
    "--max-total-tokens",
    "65536",
    "--chunked-prefill-size",
    "16",
    "--page-size",
    "4",
    "--max-running-requests",
    "6",
]


@pytest.fixture(scope="module")
def overlapped_server(tiny_model):
    """The batched test's overlap_on/spec_off server, which the seq_lens test counts on too."""
    with running_server(server_args(tiny_model, *BATCHED_FLAGS)) as server:
        yield server


@pytest.fixture(scope="module")
def plain_loop_server(tiny_model):
    with running_server(server_args(tiny_model, *BATCHED_FLAGS, "--disable-overlap")) as server:
        yield server


SHARED_SERVERS = {("overlap_on", "spec_off"): "overlapped_server", ("overlap_off", "spec_off"): "plain_loop_server"}


@pytest.mark.parametrize("spec", list(SPEC))
@pytest.mark.parametrize("overlap", list(OVERLAP))
def test_greedy_output_is_identical_with_overlap_and_speculation_batched_and_chunked(
    overlap, spec, tiny_model, reference, request
):
    shared = SHARED_SERVERS.get((overlap, spec))
    if shared:
        outputs, stats = serve_greedy(request.getfixturevalue(shared), repetitive_workload(), MAX_NEW)
    else:
        outputs, stats = serve(tiny_model, BATCHED_FLAGS + OVERLAP[overlap] + SPEC[spec], repetitive_workload())
    assert outputs == reference
    if spec == "spec_ngram":
        assert stats["spec_accepted_drafts"] > 0  # drafts were really accepted, not just proposed


@pytest.mark.parametrize("spec", list(SPEC))
@pytest.mark.parametrize("overlap", list(OVERLAP))
def test_greedy_output_is_identical_under_retraction_with_overlap_and_speculation(
    overlap, spec, tiny_model, retraction_reference
):
    flags = ["--max-total-tokens", "240", "--page-size", "4", "--max-prefill-tokens", "4096"]
    outputs, stats = serve(tiny_model, flags + OVERLAP[overlap] + SPEC[spec], retraction_workload(), RETRACTION_NEW)
    assert stats["retractions"] > 0
    assert outputs == retraction_reference


def test_exactly_one_seq_lens_copy_per_overlapped_step(overlapped_server, plain_loop_server):
    """Hundreds of steps with requests joining and leaving: the worker's copy counter equals
    the number of overlapped steps the scheduler sent, and the plain loop makes none. The
    counters are the servers' totals, so they hold over whatever else the servers ran."""
    rng = np.random.default_rng(9)
    prompts = [rng.integers(100, 20000, int(n)).tolist() for n in rng.integers(3, 120, 24)]
    lengths = [int(n) for n in rng.integers(5, 160, 24)]

    def run(server: Server) -> dict:
        http = server.http()
        before = server.scheduler_stats()["generation_tokens"]

        def one(i: int) -> int:
            body = {
                "input_ids": prompts[i],
                "sampling_params": {"max_new_tokens": lengths[i], "temperature": 0, "ignore_eos": True},
            }
            return http.post("/generate", json=body).status_code

        with ThreadPoolExecutor(24) as pool:
            assert list(pool.map(one, range(24))) == [200] * 24
        assert wait_until(lambda: server.scheduler_stats()["generation_tokens"] >= before + sum(lengths), 10)
        return server.scheduler_stats()

    overlapped = run(overlapped_server)
    assert overlapped["steps"] >= 200
    assert overlapped["overlapped_steps"] > 0.8 * overlapped["steps"]
    assert overlapped["seq_lens_d2h_copies"] == overlapped["overlapped_steps"]
    plain = run(plain_loop_server)
    assert plain["steps"] >= 200 and plain["overlapped_steps"] == 0 and plain["seq_lens_d2h_copies"] == 0


@pytest.mark.parametrize("variant", ["overlap_off", "spec_overlap_on"])
def test_real_smollm2_greedy_text_is_identical_with_overlap_and_speculation(variant, smollm2_server, request):
    prompts = [
        "Repeat exactly: the quick brown fox jumps over the lazy dog. The quick brown fox",
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
        "The capital of France is",
    ]
    http = smollm2_server.http()

    def reference(p: str) -> list[int]:
        body = {"text": p, "sampling_params": {"max_new_tokens": 32, "temperature": 0}}
        return http.post("/generate", json=body).json()["output_ids"]

    want = [reference(p) for p in prompts]
    with ExitStack() as stack:
        if variant == "overlap_off":
            server = request.getfixturevalue("smollm2_plain_loop_server")
        else:
            args = ["--dtype", "float32", "--check-seq-lens", "--max-total-tokens", "8192"]
            server = stack.enter_context(running_server([*args, "--speculative-algorithm", "ngram"]))
        other = server.http()
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(
                pool.map(
                    lambda p: other.post(
                        "/generate", json={"text": p, "sampling_params": {"max_new_tokens": 32, "temperature": 0}}
                    ).json()["output_ids"],
                    prompts,
                )
            )
    assert got == want


def test_the_ngram_drafter_looks_up_runs_from_its_longest_to_its_shortest():
    from gpu_worker.runtime.ngram_drafter import NgramDrafter

    history = [1, 2, 3, 9, 8, 5, 2, 3, 7, 1, 2, 3]
    drafter = NgramDrafter(1, 2, ngram_min=2, ngram_max=3)
    drafter.note_tokens(0, history)
    assert drafter.propose(0).tolist() == [9, 8]  # "1 2 3" recurs: what followed it
    shortest_two = NgramDrafter(1, 2, ngram_min=2, ngram_max=2)
    shortest_two.note_tokens(0, history)
    assert shortest_two.propose(0).tolist() == [7, 1]  # "2 3": its latest earlier occurrence
    too_long = NgramDrafter(1, 2, ngram_min=4, ngram_max=5)
    too_long.note_tokens(0, history)
    assert too_long.propose(0).tolist() == []
