"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions, against the default float32 server through the
official openai client: its beams are the ones the same search keeps over transformers'
float32 logits, ranked alike, and what beam search cannot take is a 400 naming it."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from tests.helpers import wait_until

MODEL = "smollm2-135m"
PROMPT = "The capital of France is"


def reference_beam_search(
    model, prompt_ids: list[int], width: int, steps: int, length_penalty: float, end_ids: set[int]
) -> list[tuple[list[int], float, bool]]:
    """(tokens, summed logprob, finished) of the best `width` beams: each step extends every
    live beam by its 2 x width likeliest tokens and keeps the width best extensions; an end
    token finishes a beam; the ranking divides by length ** length_penalty, the end token not
    counted."""
    live, finished = [([], 0.0, False)], []
    for _ in range(steps):
        extensions = []
        for tokens, cum, _ in live:
            with torch.no_grad():
                logits = model(torch.tensor([prompt_ids + tokens])).logits[0, -1]
            top = torch.topk(torch.log_softmax(logits.double(), -1), 2 * width)
            for token, logprob in zip(top.indices.tolist(), top.values.tolist()):
                ends = token in end_ids
                (finished if ends else extensions).append((tokens + [token], cum + logprob, ends))
        live = sorted(extensions, key=lambda b: b[1], reverse=True)[:width]

    def score(beam: tuple[list[int], float, bool]) -> float:
        return beam[1] / max(len(beam[0]) - beam[2], 1) ** length_penalty

    return sorted(finished + live, key=score, reverse=True)[:width]


@pytest.mark.parametrize("length_penalty", [1.0, 0.0])
def test_beam_search_keeps_and_ranks_the_beams_transformers_logits_give(smollm2_server, hf_reference, length_penalty):
    tokenizer, model = hf_reference
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    period = tokenizer.encode(".", add_special_tokens=False)[0]
    out = smollm2_server.client().completions.create(
        model=MODEL,
        prompt=prompt_ids,
        n=3,
        max_tokens=6,
        logprobs=1,
        # The period ends a beam (and the model's own end token does not): beams finish early.
        extra_body={
            "use_beam_search": True,
            "length_penalty": length_penalty,
            "stop_token_ids": [period],
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    expected = reference_beam_search(model, prompt_ids, 3, 6, length_penalty, {period})
    assert any(finished for _, _, finished in expected) and not all(finished for _, _, finished in expected)
    assert [c.index for c in out.choices] == [0, 1, 2]
    for choice, (tokens, cum, finished) in zip(out.choices, expected, strict=True):
        assert choice.model_extra["token_ids"] == tokens
        assert sum(choice.logprobs.token_logprobs) == pytest.approx(cum, abs=1e-3)
        assert choice.finish_reason == ("stop" if finished else "length")
        assert choice.text == tokenizer.decode(tokens[:-1] if finished else tokens)  # the end token is not text
    assert out.usage.completion_tokens == sum(len(tokens) for tokens, _, _ in expected)


def test_chat_beam_search_answers_with_the_beams_of_the_rendered_conversation(smollm2_server, hf_reference):
    tokenizer, model = hf_reference
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = smollm2_server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a colour."}],
        n=2,
        max_tokens=8,
        logprobs=True,
        top_logprobs=1,
        extra_body={
            "use_beam_search": True,
            "stop_token_ids": [end_of_turn],
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    prompt_ids = out.model_extra["prompt_token_ids"]
    expected = reference_beam_search(model, prompt_ids, 2, 8, 1.0, {end_of_turn})
    assert [c.index for c in out.choices] == [0, 1]
    for choice, (tokens, cum, finished) in zip(out.choices, expected, strict=True):
        assert choice.model_extra["token_ids"] == tokens
        assert sum(t.logprob for t in choice.logprobs.content) == pytest.approx(cum, abs=1e-3)
        assert choice.finish_reason == ("stop" if finished else "length")
        assert choice.message.content == tokenizer.decode(tokens[:-1] if finished else tokens)


def test_a_batch_of_prompts_gets_each_prompts_own_beams(smollm2_server):
    client = smollm2_server.client()
    prompts = [PROMPT, "Once upon a time"]
    kw = dict(model=MODEL, n=2, max_tokens=5, extra_body={"use_beam_search": True, "return_token_ids": True})
    batch = sorted(client.completions.create(prompt=prompts, **kw).choices, key=lambda c: c.index)
    alone = [client.completions.create(prompt=p, **kw).choices for p in prompts]
    assert [c.index for c in batch] == [0, 1, 2, 3]
    assert [c.model_extra["token_ids"] for c in batch] == [c.model_extra["token_ids"] for cs in alone for c in cs]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"stream": True}, "stream"),
        ({"n": 11}, "n"),
        ({"stop": ["."]}, "stop"),
        ({"best_of": 3}, "best_of"),
        ({"extra_body": {"response_format": {"type": "json_object"}}}, "response_format"),
    ],
)
def test_what_beam_search_cannot_take_is_a_400_naming_it(smollm2_server, body, param):
    body = dict(body)
    extra = {"use_beam_search": True, **body.pop("extra_body", {})}
    with pytest.raises(openai.BadRequestError) as err:
        smollm2_server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body=extra, **body)
    assert err.value.body["param"] == param, err.value.body


def test_chat_beam_search_refuses_a_forced_tool_call_naming_it(smollm2_server):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as err:
        smollm2_server.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Weather?"}],
            tools=[tool],
            tool_choice="required",
            max_tokens=4,
            extra_body={"use_beam_search": True},
        )
    assert err.value.body["param"] == "tool_choice", err.value.body


def test_aborting_a_beam_search_by_its_request_id_returns_the_beams_so_far(smollm2_server):
    client, http = smollm2_server.client(), smollm2_server.http()
    with ThreadPoolExecutor(1) as pool:
        searching = pool.submit(
            client.completions.create,
            model=MODEL,
            prompt=PROMPT,
            n=2,
            max_tokens=400,
            extra_body={"use_beam_search": True, "ignore_eos": True, "request_id": "beam-to-abort"},
        )
        time.sleep(1.0)  # a few steps in
        # Until a step is open to abort: between steps there is nothing in flight to name.
        assert wait_until(lambda: http.post("/abort", json={"rid": "cmpl-beam-to-abort"}).json()["aborted"], 30)
        out = searching.result(timeout=30)
    # Every live beam: both, or the one empty beam when the abort came during the first step.
    assert [c.finish_reason for c in out.choices] in (["abort", "abort"], ["abort"])
    assert out.usage.completion_tokens < 2 * 400
