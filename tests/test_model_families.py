"""Every family we serve equals transformers, through the real server.

One random-weight checkpoint per family (tests/family_models.py, written by transformers'
own classes with the family's quirks on), served by `launch.py --model DIR`. In float32,
greedy tokens equal transformers `generate()` token for token: a short prompt, a prompt
longer than the sliding window cut into prefill chunks that cross the window's edge, and
that prompt again (its prefix from the radix cache). The windowed families also run with
the torch decode attention (the reference path) and n-gram speculative verification;
Phi-3 and Gemma 3 also at tensor parallel 2, and the mixture-of-experts families
(Qwen3-MoE, Qwen2-MoE, Mixtral) at tensor parallel 1 and 2. In
bfloat16 (the default fast path: C++ kernels, flat decode loop), the served tokens are
float32 transformers' top-1 at most positions, teacher-forced on the served text.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.family_models import (
    FAMILY_CHECKPOINTS,
    MOE_CHECKPOINTS,
    WINDOW,
    make_family_checkpoint,
    transformers_greedy,
)
from tests.helpers import running_server

MAX_TOKENS = 16
CHUNK = 8
"""Prefill chunk: a 40-token prompt's chunks end at 8, 16, ...: each later chunk sees keys
on both sides of a 12-key window's edge."""


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    short = torch.randint(100, 40000, (6,), generator=g).tolist()
    # A repeated phrase: n-gram drafting finds matches in it, so drafts are verified.
    phrase = torch.randint(100, 40000, (8,), generator=g).tolist()
    long = phrase * 5
    assert len(long) > WINDOW + CHUNK
    return [short, long]


@pytest.fixture(scope="module")
def family_case(tmp_path_factory) -> Callable[[str], tuple[str, list[list[int]]]]:
    """name -> (the family's random-weight checkpoint, transformers' float32 greedy tokens for
    each of `_prompts()`): written and generated once per module, whichever test asks first."""

    @functools.cache
    def case(name: str) -> tuple[str, list[list[int]]]:
        path = make_family_checkpoint(str(tmp_path_factory.mktemp(name)), name)
        want = [transformers_greedy(path, p, MAX_TOKENS) for p in _prompts()]
        assert all(len(set(tokens)) > 4 for tokens in want), f"{name}: the checkpoint repeats itself: {want}"
        return path, want

    return case


@pytest.fixture(scope="module", params=FAMILY_CHECKPOINTS)
def family_checkpoint(request, family_case) -> tuple[str, str]:
    return request.param, family_case(request.param)[0]


def _serve(server, prompts: list[list[int]]) -> list[list[int]]:
    http = server.http()
    params = {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}

    def one(ids: list[int]) -> list[int]:
        r = http.post("/generate", json={"input_ids": ids, "sampling_params": params})
        r.raise_for_status()
        return r.json()["output_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        served = list(pool.map(one, prompts))
    served.append(one(prompts[-1]))  # the long prompt again: a radix-cache hit
    return served


def test_float32_greedy_equals_transformers_token_for_token(family_checkpoint, family_case):
    name, path = family_checkpoint
    want = family_case(name)[1]
    args = ["--model", path, "--dtype", "float32", "--chunked-prefill-size", str(CHUNK)]
    with running_server(args) as server:
        served = _serve(server, _prompts())
    assert served == [*want, want[-1]], name


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_windowed_families_equal_transformers_on_the_torch_path_with_ngram_drafts(name, family_case):
    path, want = family_case(name)
    args = ["--model", path, "--dtype", "float32", "--chunked-prefill-size", str(CHUNK)]
    args += ["--decode-attention", "torch", "--speculative-algorithm", "ngram"]
    with running_server(args) as server:
        served = _serve(server, _prompts())
    assert served == [*want, want[-1]], name


@pytest.mark.parametrize("name", ["phi3", "gemma3"])
def test_families_split_over_two_ranks_equal_transformers(name, family_case):
    """Tensor parallel: Phi-3's fused tensors sliced per rank, Gemma 3's q/k norms, windows
    and sandwich norms on a rank's share of the heads."""
    path, want = family_case(name)
    args = ["--model", path, "--dtype", "float32", "--chunked-prefill-size", str(CHUNK), "--tp-size", "2"]
    with running_server(args) as server:
        served = _serve(server, _prompts())
    assert served == [*want, want[-1]], name


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", MOE_CHECKPOINTS)
def test_moe_families_equal_transformers_at_one_and_two_ranks(name, tp, family_case):
    """Routing (top-k, renormalised or not), experts, Qwen2-MoE's gated shared expert and a
    dense layer among sparse ones (Qwen3-MoE); at tp 2 each rank holds half of every
    expert's intermediate dimension."""
    path, want = family_case(name)
    args = ["--model", path, "--dtype", "float32", "--chunked-prefill-size", str(CHUNK), "--tp-size", str(tp)]
    with running_server(args) as server:
        served = _serve(server, _prompts())
    assert served == [*want, want[-1]], name


BF16_SLACK = 0.1
"""Our bf16 may agree with float32 on this much fewer of the positions than transformers'
own bf16 does (measured: docs/benchmarks.md)."""


def test_bfloat16_fast_path_serves_each_family_about_as_close_to_float32_as_transformers_bf16(family_checkpoint):
    assert_bf16_about_as_close_as_transformers(*family_checkpoint)


def test_bfloat16_fast_path_serves_a_moe_family_about_as_close_to_float32_as_transformers_bf16(family_case):
    """Qwen2-MoE: the router and the shared expert's one-row gate on the bf16 kernels, the
    experts in the flat decode loop."""
    assert_bf16_about_as_close_as_transformers("qwen2_moe", family_case("qwen2_moe")[0])


def assert_bf16_about_as_close_as_transformers(name: str, path: str) -> None:
    from transformers import AutoModelForCausalLM

    prompts = _prompts()
    with running_server(["--model", path, "--chunked-prefill-size", str(CHUNK)]) as server:
        served = _serve(server, prompts)[: len(prompts)]
    float32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    bfloat16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ours = theirs = total = 0
    for prompt, out in zip(prompts, served, strict=True):
        ids = torch.tensor([prompt + out])
        with torch.no_grad():
            want = float32(ids).logits[0, len(prompt) - 1 : -1].argmax(-1)
            hf_bf16 = bfloat16(ids).logits[0, len(prompt) - 1 : -1].argmax(-1)
        ours += int((want == torch.tensor(out)).sum())
        theirs += int((want == hf_bf16).sum())
        total += len(out)
    assert ours >= theirs - BF16_SLACK * total, f"{name}: ours {ours}/{total}, transformers bf16 {theirs}"
