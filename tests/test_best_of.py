"""OpenAI's `best_of` on /v1/completions, against the default server through the official
openai client: a prompt runs best_of seeded candidates and answers with the n whose tokens
have the highest mean logprob. The candidates are the choices the same request gives with
n = best_of (seeded sampling does not depend on the batch), so the ranking is checked
against them."""

from __future__ import annotations

import openai
import pytest

MODEL = "smollm2-135m"
PROMPT = "My favourite colour is"


def _mean_logprob(choice) -> float:
    lps = choice.logprobs.token_logprobs
    return sum(lps) / len(lps)


def _ranked(choices) -> list:
    """Best first; a tie keeps the earlier candidate first (sorted is stable)."""
    return sorted(sorted(choices, key=lambda c: c.index), key=_mean_logprob, reverse=True)


def test_best_of_answers_with_the_candidates_whose_tokens_have_the_highest_mean_logprob(smollm2_server):
    client = smollm2_server.client()
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=11)
    every = client.completions.create(n=4, logprobs=0, **kw)
    assert len({c.text for c in every.choices}) >= 3  # candidates that differ: the choice is a real one
    ranked = _ranked(every.choices)
    # Apart by more than a repeat's rounding (the repeat reads its prompt from the prefix cache).
    assert _mean_logprob(ranked[0]) - _mean_logprob(ranked[1]) > 1e-3
    assert _mean_logprob(ranked[1]) - _mean_logprob(ranked[2]) > 1e-3

    best = client.completions.create(n=2, best_of=4, logprobs=0, **kw)
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    for got, want in zip(best.choices, ranked[:2]):
        assert got.logprobs.token_logprobs == pytest.approx(want.logprobs.token_logprobs, abs=1e-4)
    assert best.usage.completion_tokens == every.usage.completion_tokens  # every candidate ran

    alone = client.completions.create(best_of=4, **kw)  # n = 1, and no logprobs asked for
    assert [c.text for c in alone.choices] == [ranked[0].text]
    assert alone.choices[0].logprobs is None


def test_each_prompt_of_a_batch_gets_the_best_of_its_own_candidates(smollm2_server):
    client = smollm2_server.client()
    prompts = [PROMPT, "Once upon a time, in a small village,"]
    kw = dict(model=MODEL, prompt=prompts, max_tokens=10, temperature=1.0, seed=5)
    every = sorted(client.completions.create(n=3, logprobs=0, **kw).choices, key=lambda c: c.index)
    ranked = [_ranked(every[i * 3 : i * 3 + 3]) for i in range(2)]
    assert all(_mean_logprob(r[0]) - _mean_logprob(r[1]) > 1e-3 for r in ranked)  # one clear winner each
    best = client.completions.create(best_of=3, **kw)
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == [r[0].text for r in ranked]


def test_best_of_equal_to_n_streams_as_n_does(smollm2_server):
    client = smollm2_server.client()
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3, n=2)
    texts = ["", ""]
    for chunk in client.completions.create(best_of=2, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in sorted(client.completions.create(**kw).choices, key=lambda c: c.index)]


@pytest.mark.parametrize(
    "body",
    [
        {"n": 3, "best_of": 2},  # fewer candidates than choices
        {"best_of": 3, "stream": True},  # the best are known only at the end
        {"best_of": 17},  # more than n may be
        {"best_of": 0},
    ],
)
def test_a_best_of_that_cannot_be_served_is_a_400_naming_it(smollm2_server, body):
    with pytest.raises(openai.BadRequestError) as err:
        smollm2_server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **body)
    assert err.value.body["param"] == "best_of", err.value.body


def test_chat_refuses_best_of_as_openai_does(smollm2_server):
    with pytest.raises(openai.BadRequestError) as err:
        smollm2_server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_body={"best_of": 2}
        )
    assert err.value.body["param"] == "best_of", err.value.body
