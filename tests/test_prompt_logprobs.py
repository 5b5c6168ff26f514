"""Prompt logprobs: echo with logprobs, vLLM's prompt_logprobs and SGLang's input_token_logprobs
equal transformers' float32 log_softmax of the same prompt, through chunked prefill, the radix
cache and a worker killed mid-prefill and mid-decode."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import torch

from scheduler_proc.prompt_logprobs import chunk_scoring
from scheduler_proc.request import Req
from tests.helpers import Server, wait_until
from tests.workload import child
from trident.wire.codec import unpack_int32
from trident.wire.frontend import SamplingParams

MODEL = "smollm2-135m"
ATOL = 2e-3
"""float32 on both sides; the kernels differ in summation order."""
TEXT = (
    "The history of the city begins with a small fishing village on the river. Over the centuries, "
    "merchants built warehouses along the docks, and the town grew into a busy port."
)


def reference_logprobs(hf_reference, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: row p - 1 is the distribution of token p given the tokens before it."""
    _, model = hf_reference
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def token_logprobs(ref: torch.Tensor, ids: list[int]) -> np.ndarray:
    return ref.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).numpy()


def encode(hf_reference, text: str) -> list[int]:
    return hf_reference[0](text).input_ids


# ---------------------------------------------------------------- scheduler planning


def test_each_chunk_scores_the_prompt_tokens_after_its_positions_exactly_once():
    prompt = np.arange(100, 110, dtype=np.int32)
    for start_from, expected in ((0, prompt[1:]), (1, prompt[1:]), (6, prompt[6:]), (9, prompt[9:])):
        req = Req("r", prompt, SamplingParams(max_new_tokens=1, prompt_logprobs_from=start_from))
        scored: list[int] = []
        for start in range(0, 10, 4):
            score_from, targets = chunk_scoring(req, start, min(4, 10 - start))
            if targets:  # the position before each scored token runs in this chunk
                assert start + score_from + 1 == max(1, start_from) + len(scored)
            scored += unpack_int32(targets).tolist()
        assert scored == expected.tolist()
        assert req.reusable_prefix() == max(1, start_from) - 1
    plain = Req("p", prompt, SamplingParams(max_new_tokens=1))
    assert chunk_scoring(plain, 0, 10) == (-1, b"") and plain.reusable_prefix() == 10


def test_scores_are_sent_once_and_a_lost_prefill_scores_again():
    req = Req("r", np.arange(5, dtype=np.int32), SamplingParams(max_new_tokens=1, prompt_logprobs_from=0))
    assert req.take_prompt_logprobs().start == 1  # nothing scored yet: an empty list, from 1
    assert req.take_prompt_logprobs() is None and chunk_scoring(req, 0, 5) == (-1, b"")
    req.reset_kv_state()
    assert req.score_start() == -1  # sent before the loss: never again


# ---------------------------------------------------------------- the shared float32 server


def test_echo_with_logprobs_and_max_tokens_0_scores_every_prompt_token_as_transformers(smollm2_server, hf_reference):
    ids = encode(hf_reference, TEXT)
    ref = reference_logprobs(hf_reference, ids)
    out = smollm2_server.client().completions.create(
        model=MODEL, prompt=ids, echo=True, logprobs=3, max_tokens=0, temperature=0
    )
    choice = out.choices[0]
    assert choice.text == hf_reference[0].decode(ids)
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:], token_logprobs(ref, ids), atol=ATOL)
    best = ref.max(dim=-1).values.numpy()
    for p in range(1, len(ids)):
        assert lp.tokens[p] in lp.top_logprobs[p]
        assert 3 <= len(lp.top_logprobs[p]) <= 4  # the top 3, and the prompt token if not among them
        assert max(lp.top_logprobs[p].values()) == pytest.approx(best[p - 1], abs=ATOL)


def test_lm_eval_style_echo_with_one_generated_token_puts_it_after_the_prompt(smollm2_server, hf_reference):
    """lm-eval sends max_tokens 1 with echo and drops the last entry: the prompt comes first."""
    ids = encode(hf_reference, "The capital of France is")
    out = smollm2_server.client().completions.create(
        model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and out.usage.completion_tokens == 1
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    assert out.choices[0].text.startswith(hf_reference[0].decode(ids))


def test_a_streamed_echo_sends_the_prompt_with_its_logprobs_first(smollm2_server, hf_reference):
    ids = encode(hf_reference, "The three primary colors are")
    stream = smollm2_server.client().completions.create(
        model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=2, temperature=0, stream=True
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    assert chunks[0].text == hf_reference[0].decode(ids)
    first = chunks[0].logprobs
    assert len(first.token_logprobs) == len(ids) and first.token_logprobs[0] is None
    assert all(v is not None for v in first.token_logprobs[1:])
    assert sum(len(c.logprobs.tokens) for c in chunks[1:] if c.logprobs) == 2


def test_a_batch_of_prompts_gives_each_choice_its_own_prompt_and_echo_logprobs(smollm2_server, hf_reference):
    """A list prompt, as strings and as token ids: prompt i's n choices are indices i * n on
    (OpenAI's and vLLM's numbering), each echoing its own prompt with its logprobs."""
    texts = ["The capital of France is", TEXT]
    prompts = [encode(hf_reference, t) for t in texts]
    expected = [token_logprobs(reference_logprobs(hf_reference, ids), ids) for ids in prompts]
    client = smollm2_server.client()
    for prompt in (texts, prompts):
        out = client.completions.create(
            model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=0, n=2, extra_body={"prompt_logprobs": 0}
        )
        assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
        assert out.usage.prompt_tokens == sum(map(len, prompts)) and out.usage.completion_tokens == 0
        for choice in out.choices:
            i = choice.index // 2
            assert choice.text == hf_reference[0].decode(prompts[i])
            assert len(choice.logprobs.tokens) == len(prompts[i]) and choice.logprobs.token_logprobs[0] is None
            np.testing.assert_allclose(choice.logprobs.token_logprobs[1:], expected[i], atol=ATOL)
            assert len(choice.model_extra["prompt_logprobs"]) == len(prompts[i])
    stream = client.completions.create(
        model=MODEL, prompt=prompts, echo=True, logprobs=0, max_tokens=1, temperature=0, stream=True
    )
    firsts: dict[int, object] = {}
    for chunk in stream:
        for choice in chunk.choices:
            firsts.setdefault(choice.index, choice)
    assert sorted(firsts) == [0, 1]
    for i, choice in firsts.items():  # each choice's first chunk: its own prompt, scored
        assert choice.text == hf_reference[0].decode(prompts[i])
        np.testing.assert_allclose(choice.logprobs.token_logprobs[1:], expected[i], atol=ATOL)


def test_vllm_prompt_logprobs_give_each_prompt_token_its_logprob_rank_and_top(smollm2_server, hf_reference):
    ids = encode(hf_reference, "Once upon a time, in a small village, there lived")
    ref = reference_logprobs(hf_reference, ids)
    out = smollm2_server.client().completions.create(
        model=MODEL, prompt=ids, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    entries = out.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for p in range(1, len(ids)):
        row = ref[p - 1]
        own = entries[p][str(ids[p])]
        assert own["logprob"] == pytest.approx(row[ids[p]].item(), abs=ATOL)
        assert own["rank"] == int((row > row[ids[p]]).sum()) + 1 or abs(row[ids[p]] - row.max()) < ATOL
        assert own["decoded_token"] == hf_reference[0].decode([ids[p]])
        top = sorted((e for e in entries[p].values() if e["rank"] <= 2), key=lambda e: e["rank"])
        assert [e["rank"] for e in top] == [1, 2]
        assert top[0]["logprob"] == pytest.approx(row.max().item(), abs=ATOL)


def test_chat_prompt_logprobs_cover_the_templated_prompt(smollm2_server):
    out = smollm2_server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )
    entries = out.model_extra["prompt_logprobs"]
    assert len(entries) == out.usage.prompt_tokens and entries[0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["logprob"] <= 0 for e in entries[1:])
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):  # no place for them in a stream
        smollm2_server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True, extra_body={"prompt_logprobs": 0}
        )


def test_sglang_generate_returns_input_logprobs_from_logprob_start_len(smollm2_server, hf_reference):
    ids = encode(hf_reference, TEXT)
    ref = reference_logprobs(hf_reference, ids)
    body = {
        "input_ids": ids,
        "return_logprob": True,
        "logprob_start_len": 3,
        "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0},
    }
    meta = smollm2_server.http().post("/generate", json=body).json()["meta_info"]
    inputs = meta["input_token_logprobs"]
    assert [t for _, t, _ in inputs] == ids[3:]
    np.testing.assert_allclose([lp for lp, _, _ in inputs], token_logprobs(ref, ids)[2:], atol=ATOL)
    assert all(len(top) == 2 for top in meta["input_top_logprobs"])
    assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == 2


def test_max_tokens_0_without_echo_answers_an_empty_completion(smollm2_server):
    out = smollm2_server.client().completions.create(model=MODEL, prompt="Hello there", max_tokens=0)
    assert out.choices[0].text == "" and out.usage.completion_tokens == 0
    assert out.choices[0].finish_reason == "length"


# ---------------------------------------------------------------- chunks, cache, restarts


@pytest.fixture(scope="module")
def chunked_server():
    """Prompt chunks of 8 tokens, so that every prompt here spans several steps."""
    server = Server(
        ["--dtype", "float32", "--max-total-tokens", "8192", "--chunked-prefill-size", "8", "--check-seq-lens"]
    )
    yield server
    server.stop()


def echo_scores(server: Server, ids: list[int]) -> tuple[list[float], int]:
    """(every prompt token's logprob after the first, cached tokens) of echo with max_tokens 0."""
    out = server.client().completions.create(model=MODEL, prompt=ids, echo=True, logprobs=0, max_tokens=0)
    assert out.choices[0].logprobs.token_logprobs[0] is None
    return out.choices[0].logprobs.token_logprobs[1:], out.usage.prompt_tokens_details.cached_tokens


def test_prompt_logprobs_through_chunked_prefill_of_concurrent_requests(chunked_server, hf_reference):
    texts = [TEXT, "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,", "import numpy as np\nx = np.arange(10)\n"]
    prompts = [encode(hf_reference, t) for t in texts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        served = list(pool.map(lambda ids: echo_scores(chunked_server, ids)[0], prompts))
    for ids, got in zip(prompts, served):
        np.testing.assert_allclose(got, token_logprobs(reference_logprobs(hf_reference, ids), ids), atol=ATOL)


def test_a_cached_prefix_is_reused_only_up_to_the_first_scored_position(chunked_server, hf_reference):
    ids = encode(hf_reference, "A different story: " + TEXT)
    expected = token_logprobs(reference_logprobs(hf_reference, ids), ids)
    chunked_server.client().completions.create(model=MODEL, prompt=ids, max_tokens=1)  # caches the prompt
    start = 20
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": start}
    meta = chunked_server.http().post("/generate", json={**body, "sampling_params": {"max_new_tokens": 1}}).json()
    assert meta["meta_info"]["cached_tokens"] == start - 1  # page size 1: right up to the scored position
    np.testing.assert_allclose(
        [lp for lp, _, _ in meta["meta_info"]["input_token_logprobs"]], expected[start - 1 :], atol=ATOL
    )
    got, cached = echo_scores(chunked_server, ids)
    assert cached == 0  # every position scored: nothing of the cache is taken
    np.testing.assert_allclose(got, expected, atol=ATOL)


def test_a_worker_killed_mid_prefill_and_mid_decode_still_returns_every_prompt_logprob_once(
    chunked_server, hf_reference
):
    """Two requests decode and two long prompts are still in their 8-token chunks when the
    worker is SIGKILLed: all four come back with each prompt logprob once, as transformers'."""
    short = [encode(hf_reference, t) for t in ("The three primary colors are", "To make a cup of tea, first")]
    long = [encode(hf_reference, (TEXT + " ") * 6 + suffix) for suffix in ("Today", "Tomorrow")]
    client = chunked_server.client(timeout=300)
    restarts_before = chunked_server.counter("trident_restarts_total")
    resumed_before = chunked_server.scheduler_stats().get("resumed_requests", 0)
    results: dict[int, object] = {}

    def run(i: int, ids: list[int], max_tokens: int) -> None:
        results[i] = client.completions.create(
            model=MODEL, prompt=ids, max_tokens=max_tokens, temperature=0, extra_body={"prompt_logprobs": 0}
        )

    threads = [threading.Thread(target=run, args=(i, ids, 60)) for i, ids in enumerate(short)]
    generated_before = chunked_server.counter("trident_generation_tokens_total")
    for t in threads:
        t.start()
    assert wait_until(lambda: chunked_server.counter("trident_generation_tokens_total") > generated_before + 4, 60)
    threads += [threading.Thread(target=run, args=(2 + i, ids, 4)) for i, ids in enumerate(long)]
    for t in threads[2:]:
        t.start()
    time.sleep(0.5)  # the long prompts are a few of their chunks in
    child(chunked_server, "trident::worker[tp0]").kill()
    for t in threads:
        t.join(300)
    assert wait_until(lambda: chunked_server.counter("trident_restarts_total") == restarts_before + 1, 30)
    # All four were running when the worker died, and went back as prefills.
    assert wait_until(lambda: chunked_server.scheduler_stats()["resumed_requests"] >= resumed_before + 4, 10)
    for i, ids in enumerate(short + long):
        entries = results[i].choices[0].model_extra["prompt_logprobs"]
        assert len(entries) == len(ids) and entries[0] is None
        assert all(len(e) == 1 for e in entries[1:])  # the prompt token's own entry, no duplicate
        got = [e[str(t)]["logprob"] for e, t in zip(entries[1:], ids[1:])]
        np.testing.assert_allclose(got, token_logprobs(reference_logprobs(hf_reference, ids), ids), atol=ATOL)
