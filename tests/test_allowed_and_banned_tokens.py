"""vLLM's `allowed_token_ids` and `bad_words` on the OpenAI routes, against the default server
through the official openai client: the tokens a request may sample, and the words its output
must not contain."""

from __future__ import annotations

import openai
import pytest
import torch

from gpu_worker.runtime.sampler import SamplingTable, banned_tokens
from tests.helpers import smollm2_tokenizer
from tokenizer_proc.tokenization import bad_word_sequences
from trident.wire.frontend import SamplingParams

MODEL = "smollm2-135m"
PROMPT = "The capital of France is"


def _contains(ids: list[int], seq: list[int]) -> bool:
    return any(ids[i : i + len(seq)] == seq for i in range(len(ids) - len(seq) + 1))


def _greedy_ids(client, prompt: str, max_tokens: int, **extra) -> list[int]:
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"return_token_ids": True, **extra}
    )
    return out.choices[0].model_extra["token_ids"]


def test_a_words_last_token_is_banned_only_where_the_output_ends_with_the_rest_of_it():
    params = SamplingParams(max_new_tokens=8, bad_words_ids=[[5], [7, 8, 9]])
    assert banned_tokens(params, []) == [5]
    assert banned_tokens(params, [1, 7]) == [5]
    assert banned_tokens(params, [7, 8]) == [5, 9]
    assert banned_tokens(params, [3, 7, 8]) == [5, 9]
    assert banned_tokens(params, [8, 7]) == [5]


def test_a_resumed_row_bans_from_the_tokens_it_had_generated_and_keeps_only_what_its_words_need():
    table = SamplingTable(max_slots=2, vocab_size=100, eos_token_ids=[0], device=torch.device("cpu"))
    params = SamplingParams(max_new_tokens=8, bad_words_ids=[[5, 6, 7], [9]])
    table.add(1, params, generated_ids=[3, 4, 5, 6])  # resubmitted after a scheduler restart
    assert table.recent_ids[1] == [5, 6] and banned_tokens(params, table.recent_ids[1]) == [7, 9]
    table.note_sampled([1], torch.tensor([8]), None)
    assert table.recent_ids[1] == [6, 8] and banned_tokens(params, table.recent_ids[1]) == [9]
    table.remove(1)
    assert 1 not in table.recent_ids


def test_allowed_token_ids_confine_every_sampled_token_on_every_route(smollm2_server):
    client = smollm2_server.client()
    tok = smollm2_tokenizer()
    allowed = [tok.encode(w, add_special_tokens=False)[0] for w in (" red", " green", " blue", " and", ",")]
    out = client.completions.create(
        model=MODEL,
        prompt="My favourite colours are",
        max_tokens=24,
        temperature=1.0,
        n=4,
        seed=7,
        extra_body={"allowed_token_ids": allowed, "return_token_ids": True},
    )
    sampled = [t for choice in out.choices for t in choice.model_extra["token_ids"]]
    assert len(sampled) == 4 * 24 and set(sampled) <= set(allowed)
    assert len(set(sampled)) >= 2, sampled  # a choice among them, not one forced token

    greedy = _greedy_ids(client, PROMPT, 6)
    assert greedy[0] not in allowed
    confined = _greedy_ids(client, PROMPT, 6, allowed_token_ids=allowed)
    assert set(confined) <= set(allowed)

    native = smollm2_server.http().post(
        "/generate",
        json={"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "allowed_token_ids": allowed}},
    )
    assert native.status_code == 200 and set(native.json()["output_ids"]) <= set(allowed), native.text

    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=8,
        temperature=0,
        extra_body={"allowed_token_ids": allowed, "return_token_ids": True},
    )
    assert set(chat.choices[0].model_extra["token_ids"]) <= set(allowed)


def test_a_bad_word_changes_greedy_text_only_where_it_would_have_been_completed(smollm2_server):
    client = smollm2_server.client()
    tok = smollm2_tokenizer()
    prompt = "The mitochondria"  # its greedy text has a word of three tokens
    greedy = _greedy_ids(client, prompt, 32)
    text = tok.decode(greedy)
    # A word of the greedy text that takes several tokens, so that its last one is banned only
    # after the others.
    word, seq = next(
        (w, s)
        for w in text.split()
        for s in bad_word_sequences(tok, [w])
        if len(s) >= 2 and w.isalpha() and _contains(greedy, s)
    )
    banned = _greedy_ids(client, prompt, 32, bad_words=[word])
    for s in bad_word_sequences(tok, [word]):
        assert not _contains(banned, s), (word, s, banned)
    end = next(i + len(seq) - 1 for i in range(len(greedy)) if greedy[i : i + len(seq)] == seq)
    assert banned[:end] == greedy[:end] and banned[end] != greedy[end]

    question = [{"role": "user", "content": "What is the capital of France?"}]
    paris = client.chat.completions.create(model=MODEL, messages=question, max_tokens=16, temperature=0)
    assert "Paris" in paris.choices[0].message.content
    no_paris = client.chat.completions.create(
        model=MODEL,
        messages=question,
        max_tokens=16,
        temperature=0,
        extra_body={"bad_words": ["Paris"]},
    )
    assert "Paris" not in no_paris.choices[0].message.content


@pytest.mark.parametrize(
    "body, param",
    [
        ({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
        ({"allowed_token_ids": ["5"]}, "allowed_token_ids"),
        ({"bad_words": "Paris"}, "bad_words"),
        ({"bad_words": [5]}, "bad_words"),
    ],
)
def test_bad_allowed_token_ids_or_bad_words_are_a_400_naming_the_field(smollm2_server, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        smollm2_server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body=body)
    assert err.value.body["param"] == param, err.value.body
