"""Each sampling parameter changes the served output as it should (real SmolLM2, official client).

Parameters of the OpenAI API go through the `openai` client's own arguments; the vLLM/SGLang
extras (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids) through
`extra_body`. Statistical checks use fixed seeds, so every run draws the same samples.
Independent requests of a test are sent together (`parallel`): the server batches them,
which keeps this file fast on a CPU and exercises per-row sampling in mixed batches.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

MODEL = "smollm2-135m"
FLAT_PROMPT = "Once upon a time, there was a"
"""A prompt whose next-token distribution is flat: sampling visibly differs from greedy."""
SPREAD_PROMPTS = [FLAT_PROMPT, "The best way to"]
REPETITIVE_PROMPT = "apple banana apple banana apple banana apple banana apple banana"
FRANCE = "The capital of France is"
CHAT_HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def client(smollm2_server):
    return smollm2_server.client(timeout=300)


def complete(client, prompt: str, **kw):
    kw.setdefault("max_tokens", 8)
    return client.completions.create(model=MODEL, prompt=prompt, **kw)


def parallel(fn: Callable[..., Any], calls: Iterable[Any]) -> list[Any]:
    """fn(*args) for each args in calls, all in flight at once; results in order."""
    calls = [c if isinstance(c, tuple) else (c,) for c in calls]
    with ThreadPoolExecutor(max(1, len(calls))) as pool:
        return [f.result() for f in [pool.submit(fn, *c) for c in calls]]


def chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=CHAT_HI, **kw)


@pytest.fixture(scope="module")
def france(client):
    """The greedy 16-token continuation of FRANCE with top-5 logprobs, shared by several tests."""
    res = complete(client, FRANCE, temperature=0, max_tokens=16, logprobs=5)
    assert res.choices[0].finish_reason == "length"
    return res.choices[0]


# ---------------------------------------------------------------- settings that collapse to greedy

RESTRICTIVE = {
    "top_k=1": {"temperature": 1.0, "extra_body": {"top_k": 1}},
    "temperature=1e-4": {"temperature": 1e-4},
    "top_p=0.01": {"temperature": 1.5, "top_p": 0.01},
    # min_p=1, not 0.99: SmolLM2 has near-ties (" your" 0.382 vs " what" 0.381 after "a clear idea of").
    "min_p=1": {"temperature": 1.0, "extra_body": {"min_p": 1.0}},
}


def test_restrictive_sampling_settings_reproduce_the_greedy_text(client):
    cases = [(name, prompt) for name in ["greedy", "plain", *RESTRICTIVE] for prompt in SPREAD_PROMPTS]

    def run(name: str, prompt: str) -> str:
        setting = {"greedy": {"temperature": 0}, "plain": {"temperature": 1.0}}.get(name) or RESTRICTIVE[name]
        return complete(client, prompt, seed=1000 + SPREAD_PROMPTS.index(prompt), **setting).choices[0].text

    texts = dict(zip(cases, parallel(run, cases)))
    for prompt in SPREAD_PROMPTS:
        # The control: with the same seeds and no restriction, temperature 1 departs from greedy.
        assert texts["plain", prompt] != texts["greedy", prompt]
        for name in RESTRICTIVE:
            assert texts[name, prompt] == texts["greedy", prompt], (name, prompt)


# ---------------------------------------------------------------- support of the distribution


def first_token_distribution(client) -> list[tuple[str, float]]:
    """The 20 most likely first tokens of FLAT_PROMPT with their probabilities, most likely first."""
    res = complete(client, FLAT_PROMPT, max_tokens=1, temperature=0, logprobs=20)
    top = res.choices[0].logprobs.top_logprobs[0]
    return sorted(((tok, math.exp(lp)) for tok, lp in top.items()), key=lambda t: -t[1])


def test_top_k_top_p_and_min_p_restrict_the_sampled_tokens_to_their_support(client):
    dist = first_token_distribution(client)
    probs = [p for _, p in dist]
    top3 = {tok for tok, _ in dist[:3]}
    # Thresholds half-way between the 3rd and 4th token, so exactly the top 3 survive each filter.
    cum_before = [sum(probs[:i]) for i in range(len(probs))]
    settings = {
        "none": {},
        "top_k": {"extra_body": {"top_k": 3}},
        "top_p": {"top_p": (cum_before[2] + cum_before[3]) / 2},
        "min_p": {"extra_body": {"min_p": (probs[2] + probs[3]) / 2 / probs[0]}},
    }
    calls = [(name, seed) for name in settings for seed in (11, 5000)]

    def draw(name: str, seed: int) -> list[str]:
        """16 first tokens drawn at temperature 1 with fixed seeds (n=16 choices)."""
        res = complete(
            client, FLAT_PROMPT, max_tokens=1, temperature=1.0, n=16, seed=seed, logprobs=0, **settings[name]
        )
        return [c.logprobs.tokens[0] for c in res.choices]

    drawn: dict[str, list[str]] = {name: [] for name in settings}
    for (name, _), tokens in zip(calls, parallel(draw, calls)):
        drawn[name] += tokens
    assert set(drawn["none"]) - top3, "the control draw never left the top 3: the prompt is too peaked"
    for name in ("top_k", "top_p", "min_p"):
        assert set(drawn[name]) <= top3, f"{name} let through {set(drawn[name]) - top3}"
        assert len(set(drawn[name])) >= 2, f"{name} collapsed to greedy instead of sampling its support"


# ---------------------------------------------------------------- seeds


def test_same_seed_gives_the_same_text_alone_and_inside_a_busy_batch(client):
    seeded = {"temperature": 1.0, "seed": 1234, "max_tokens": 10}
    alone = complete(client, FLAT_PROMPT, **seeded).choices[0].text

    started = threading.Event()

    def noise(prompt: str) -> str:
        for _ in complete(client, prompt, temperature=1.0, max_tokens=20, stream=True):
            started.set()
        return ""

    def seeded_request() -> str:
        assert started.wait(120)
        time.sleep(0.05)  # join a batch that is already decoding, in a different slot
        return complete(client, FLAT_PROMPT, **seeded).choices[0].text

    noise_prompts = ["The history of Rome", "def quicksort(arr):", "Dear diary, today", "1, 2, 3,"]
    calls = [lambda p=p: noise(p) for p in noise_prompts] + [seeded_request]
    busy = parallel(lambda f: f(), calls)[-1]
    assert busy == alone


def test_different_seeds_give_different_text(client):
    texts = parallel(lambda s: complete(client, FLAT_PROMPT, temperature=1.0, seed=s).choices[0].text, [1, 2, 3, 4])
    assert len(set(texts)) >= 3


# ---------------------------------------------------------------- penalties


def test_frequency_presence_and_repetition_penalties_lower_the_repetition_count(client):
    settings = {
        "none": {},
        "frequency": {"frequency_penalty": 1.0},
        "presence": {"presence_penalty": 1.5},
        "repetition": {"extra_body": {"repetition_penalty": 1.3}},
    }

    def repeated_tokens(name: str) -> int:
        """Tokens of a 32-token greedy continuation that repeat an earlier token of it."""
        kw = settings[name]
        extra = {"ignore_eos": True, **kw.get("extra_body", {})}
        res = complete(
            client, REPETITIVE_PROMPT, temperature=0, max_tokens=32, logprobs=0, **{**kw, "extra_body": extra}
        )
        tokens = res.choices[0].logprobs.tokens
        assert len(tokens) == 32
        return len(tokens) - len(set(tokens))

    counts = dict(zip(settings, parallel(repeated_tokens, settings)))
    assert counts["none"] >= 8, "the prompt no longer makes the model repeat itself"
    for name in ("frequency", "presence", "repetition"):
        assert counts[name] <= counts["none"] * 0.7, counts


def test_repetition_penalty_equals_transformers_also_when_the_prompt_is_in_the_prefix_cache(client, hf_reference):
    """The penalty must see every prompt token, also those whose KV the prefix cache holds."""
    tok, model = hf_reference
    prompt = f"[{uuid.uuid4().hex[:6]}] The cat sat on the mat. The cat sat on the mat. The cat sat on the"
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, repetition_penalty=1.3)
    want = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    penalised = {"temperature": 0, "max_tokens": 8, "extra_body": {"repetition_penalty": 1.3}}
    cold = complete(client, prompt, **penalised).choices[0].text
    assert cold == want
    plain = complete(client, prompt, temperature=0, max_tokens=1)  # its prompt KV is in the cache now
    assert plain.usage.prompt_tokens_details.cached_tokens > 0
    warm = complete(client, prompt, **penalised).choices[0].text
    assert warm == want


# ---------------------------------------------------------------- n and logprobs


def test_n_3_returns_three_choices_and_counts_their_tokens(client):
    res, chat_res = parallel(
        lambda f: f(),
        [
            lambda: complete(client, FLAT_PROMPT, n=3, temperature=1.0, seed=7, logprobs=0),
            lambda: chat(client, n=3, temperature=1.0, seed=7, max_tokens=4),
        ],
    )
    assert [c.index for c in res.choices] == [0, 1, 2]
    assert len({c.text for c in res.choices}) >= 2
    assert res.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in res.choices)
    assert [c.index for c in chat_res.choices] == [0, 1, 2]
    assert len({c.message.content for c in chat_res.choices}) >= 2


def test_completion_logprobs_put_the_greedy_token_at_the_top_of_its_list(france):
    lp = france.logprobs
    assert "".join(lp.tokens) == france.text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 16
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(16)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 5
        assert logprob <= 0
        assert top[token] == pytest.approx(logprob, abs=1e-6)
        assert logprob == pytest.approx(max(top.values()), abs=1e-6)
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-5


def test_chat_logprobs_list_top_logprobs_with_token_bytes(client):
    res = chat(client, temperature=0, max_tokens=10, logprobs=True, top_logprobs=3)
    content = res.choices[0].logprobs.content
    assert len(content) == res.usage.completion_tokens
    text = bytes(b for item in content for b in item.bytes).decode("utf-8", errors="replace")
    assert text.startswith(res.choices[0].message.content)
    for item in content:
        assert len(item.top_logprobs) == 3
        values = [t.logprob for t in item.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert item.top_logprobs[0].token == item.token
        assert item.logprob == pytest.approx(values[0], abs=1e-6)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-5


def test_served_logprobs_match_a_transformers_forward(france, hf_reference):
    tok, model = hf_reference
    lp = france.logprobs
    ids = tok(FRANCE, return_tensors="pt").input_ids
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :]
        full = torch.cat([ids[0], gen])[None]
        ref = torch.log_softmax(model(full).logits[0, ids.shape[1] - 1 : -1].float(), dim=-1)
    assert lp.tokens == [tok.decode([t]) for t in gen.tolist()]
    for i, token_id in enumerate(gen.tolist()):
        assert lp.token_logprobs[i] == pytest.approx(ref[i, token_id].item(), abs=1e-3)
        ref_top = ref[i].topk(5).values.tolist()
        served_top = sorted(lp.top_logprobs[i].values(), reverse=True)
        assert served_top == pytest.approx(ref_top, abs=1e-3)


# ---------------------------------------------------------------- stopping


def test_stop_string_cuts_the_text_and_finishes_with_stop(client, france):
    full = france.text
    cut = len(full) // 2
    while full.find(full[cut : cut + 3]) != cut:  # a stop string whose first occurrence is at `cut`
        cut += 1
    stop = full[cut : cut + 3]
    res, streamed = parallel(
        lambda f: f(),
        [
            lambda: complete(client, FRANCE, temperature=0, max_tokens=16, stop=["never-in-the-text", stop]),
            lambda: list(complete(client, FRANCE, temperature=0, max_tokens=16, stop=stop, stream=True)),
        ],
    )
    assert res.choices[0].text == full[:cut]
    assert res.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].text for c in streamed if c.choices) == full[:cut]
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "stop"


def test_stop_token_ids_end_the_request_at_that_token(smollm2_server, client, france):
    with smollm2_server.http() as http:
        r = http.post("/generate", json={"text": FRANCE, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    ids = r.json()["output_ids"]
    assert r.json()["text"] == "".join(france.logprobs.tokens[:8])
    j = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    res = complete(client, FRANCE, temperature=0, extra_body={"stop_token_ids": [ids[j]]})
    assert res.choices[0].finish_reason == "stop"
    assert res.usage.completion_tokens == j + 1
    assert res.choices[0].text == "".join(france.logprobs.tokens[:j])  # the stop token's text is left out


def test_ignore_eos_and_min_tokens_keep_generating_past_eos(client):
    natural = chat(client, temperature=0, max_tokens=60)
    assert natural.choices[0].finish_reason == "stop", "the model should end this reply with EOS on its own"
    n = natural.usage.completion_tokens
    ignore, at_least = parallel(
        lambda f: f(),
        [
            lambda: chat(client, temperature=0, max_tokens=n + 8, extra_body={"ignore_eos": True}),
            lambda: chat(client, temperature=0, max_tokens=n + 12, extra_body={"min_tokens": n + 6}),
        ],
    )
    assert ignore.usage.completion_tokens == n + 8
    assert ignore.choices[0].finish_reason == "length"
    assert at_least.usage.completion_tokens >= n + 6
    assert at_least.choices[0].message.content.startswith(natural.choices[0].message.content)


# ---------------------------------------------------------------- echo and streaming usage


def test_echo_prepends_the_prompt_to_the_completion(client, france):
    want = FRANCE + "".join(france.logprobs.tokens[:4])
    echoed, chunks = parallel(
        lambda f: f(),
        [
            lambda: complete(client, FRANCE, temperature=0, max_tokens=4, echo=True).choices[0].text,
            lambda: list(complete(client, FRANCE, temperature=0, max_tokens=4, echo=True, stream=True)),
        ],
    )
    assert echoed == want
    assert chunks[0].choices[0].text == FRANCE
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want


def test_stream_include_usage_sends_one_final_usage_chunk(client, france):
    want = "".join(france.logprobs.tokens[:6])
    chunks, without = parallel(
        lambda f: f(),
        [
            lambda: list(
                complete(
                    client,
                    FRANCE,
                    temperature=0,
                    max_tokens=6,
                    n=2,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            ),
            lambda: list(complete(client, FRANCE, temperature=0, max_tokens=6, stream=True)),
        ],
    )
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in body)
    assert last.usage.completion_tokens == 12
    assert last.usage.prompt_tokens == len(FRANCE.split())  # one token per word for this prompt
    for i in range(2):
        assert "".join(c.choices[0].text for c in body if c.choices and c.choices[0].index == i) == want
    assert all(c.usage is None for c in without)
    assert "".join(c.choices[0].text for c in without if c.choices) == want


def test_greedy_tokens_take_the_first_of_tied_maxima_as_argmax_does():
    from gpu_worker.runtime.sampler import greedy_tokens

    logits = torch.randn(64, 49152).to(torch.bfloat16)
    logits[:, 7] = logits.max(dim=-1).values + 1
    logits[:, 9000] = logits[:, 7]  # a tie later in the row
    logits[3, 2] = logits[3, 7]  # and one earlier in row 3
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    assert greedy_tokens(logits)[0] == 7 and greedy_tokens(logits)[3] == 2


def test_greedy_rows_short_of_min_tokens_mask_their_stop_tokens_in_the_logits_own_dtype():
    """min_tokens (as benchmarks send it) needs only the stop tokens masked: the bf16 argmax
    runs on the model's logits, and picks what the float32 path picks."""
    from gpu_worker.kernels.cpu_kernels import load_greedy_argmax
    from gpu_worker.runtime.sampler import SamplingTable, sample
    from trident.wire.frontend import SamplingParams

    vocab, eos = 4096, 5
    logits = torch.randn(3, vocab).to(torch.bfloat16)
    logits[:, eos] = 50.0  # EOS is every row's largest logit, stop token 9 the next
    logits[:, 9] = 40.0
    rows = [
        SamplingParams(max_new_tokens=8, temperature=0.0, min_new_tokens=4),  # EOS masked
        SamplingParams(max_new_tokens=8, temperature=0.0),  # nothing masked
        SamplingParams(max_new_tokens=8, temperature=0.0, min_new_tokens=4, stop_token_ids=[9]),  # EOS and 9 masked
    ]

    def run(row_logits: torch.Tensor) -> tuple[list[int], list[torch.dtype]]:
        table = SamplingTable(3, vocab, [eos], torch.device("cpu"))
        kernel, seen = load_greedy_argmax(), []
        assert kernel is not None, "the C++ kernels did not build"
        table.bf16_argmax = lambda x: seen.append(x.dtype) or kernel(x)
        for slot, params in enumerate(rows):
            table.add(slot, params, [])
        tokens, _ = sample(row_logits, [0, 1, 2], table)
        return tokens.tolist(), seen

    without_stops = logits[2].float()
    without_stops[[eos, 9]] = float("-inf")
    tokens, argmax_dtypes = run(logits)
    assert tokens == [9, eos, int(without_stops.argmax())]
    assert tokens == run(logits.float())[0]
    assert argmax_dtypes == [torch.bfloat16]


def test_seeded_noise_is_never_zero_so_forbidden_tokens_stay_forbidden():
    """A noise of 0 turns a forbidden token's probability 0 into 0 / 0, a NaN that argmax
    picks: 2,000 keys over SmolLM2's vocabulary gave 5 zeros when the uniform could round to 1."""
    from gpu_worker.runtime.sampler import hash_token_ids, seeded_exponentials

    tokens = hash_token_ids(49152, torch.device("cpu"))
    keys = torch.arange(2000, dtype=torch.int64) * 2654435761 % (1 << 32)
    noise = torch.cat([seeded_exponentials(keys[i : i + 200], tokens) for i in range(0, 2000, 200)])
    assert bool((noise > 0).all()) and bool(torch.isfinite(noise).all())
