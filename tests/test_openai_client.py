"""The official openai client against a server started by launch.py."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import openai
import pytest

from tests.helpers import running_server
from tests.structured_schemas import WEATHER_TOOL


def test_completion_through_the_official_client(smollm2_server):
    res = smollm2_server.client().completions.create(
        model="smollm2-135m", prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert res.choices[0].text.strip().startswith("Paris")
    assert res.usage.prompt_tokens == 5 and res.usage.completion_tokens == 8
    assert res.choices[0].finish_reason == "length"


def test_chat_completion_through_the_official_client(smollm2_server):
    res = smollm2_server.client().chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32,
        temperature=0,
    )
    msg = res.choices[0].message
    assert msg.role == "assistant" and "Paris" in msg.content
    assert res.usage.total_tokens == res.usage.prompt_tokens + res.usage.completion_tokens


def test_streamed_chat_completion_matches_the_non_streamed_one(smollm2_server):
    client = smollm2_server.client()
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    full = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=20, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="smollm2-135m",
            messages=messages,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_a_kept_stop_string_ends_the_text_on_every_route(smollm2_server):
    """vLLM's `include_stop_str_in_output` (completions, streamed or not, and chat) and
    SGLang's `no_stop_trim` (/generate): the greedy text up to and including the stop
    string; without them, up to it."""
    client, prompt = smollm2_server.client(), "The capital of France is"
    greedy = {"model": "smollm2-135m", "max_tokens": 24, "temperature": 0}
    free = client.completions.create(prompt=prompt, **greedy).choices[0].text
    stop = " " + free.split()[2]
    cut_at = free.index(stop)
    kept = {"stop": [stop], "extra_body": {"include_stop_str_in_output": True}}
    assert client.completions.create(prompt=prompt, stop=[stop], **greedy).choices[0].text == free[:cut_at]
    res = client.completions.create(prompt=prompt, **kept, **greedy).choices[0]
    assert res.text == free[: cut_at + len(stop)] and res.finish_reason == "stop"
    streamed = client.completions.create(prompt=prompt, stream=True, **kept, **greedy)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == free[: cut_at + len(stop)]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    answer = client.chat.completions.create(messages=messages, **greedy).choices[0].message.content
    chat_stop = " " + answer.split()[1]
    chat = client.chat.completions.create(
        messages=messages, stop=[chat_stop], extra_body={"include_stop_str_in_output": True}, **greedy
    )
    assert chat.choices[0].message.content == answer[: answer.index(chat_stop) + len(chat_stop)]
    params = {"max_new_tokens": 24, "temperature": 0, "stop": [stop], "no_stop_trim": True}
    generated = smollm2_server.http().post("/generate", json={"text": prompt, "sampling_params": params}).json()
    assert generated["text"] == free[: cut_at + len(stop)]


def test_stop_reason_names_the_stop_string_or_token_that_ended_a_choice(smollm2_server):
    """vLLM's `stop_reason`: the stop string or stop token id that ended the choice; null for
    the end-of-sequence token and the length limit. Streamed, the finishing chunk carries it."""
    client, prompt = smollm2_server.client(), "The capital of France is"
    greedy = {"model": "smollm2-135m", "max_tokens": 24, "temperature": 0}
    free = client.completions.create(prompt=prompt, extra_body={"return_token_ids": True}, **greedy)
    assert free.choices[0].finish_reason == "length" and free.choices[0].model_extra["stop_reason"] is None
    words = free.choices[0].text.split()
    stop, ids = " " + words[2], free.choices[0].model_extra["token_ids"]
    cut = client.completions.create(prompt=prompt, stop=["zzz", stop], **greedy).choices[0]
    assert cut.finish_reason == "stop" and cut.model_extra["stop_reason"] == stop
    streamed = list(client.completions.create(prompt=prompt, stop=["zzz", stop], stream=True, **greedy))
    assert [c.choices[0].model_extra["stop_reason"] for c in streamed if c.choices[0].finish_reason] == [stop]
    by_token = client.completions.create(prompt=prompt, extra_body={"stop_token_ids": [ids[3]]}, **greedy).choices[0]
    assert by_token.finish_reason == "stop" and by_token.model_extra["stop_reason"] == ids[3]
    messages = [{"role": "user", "content": "Say hello."}]
    chat = client.chat.completions.create(messages=messages, **{**greedy, "max_tokens": 200}).choices[0]
    assert chat.finish_reason == "stop" and chat.model_extra["stop_reason"] is None  # the end of the turn
    chat_stop = " " + chat.message.content.split()[1]
    stopped = client.chat.completions.create(messages=messages, stop=[chat_stop], **{**greedy, "max_tokens": 200})
    assert stopped.choices[0].model_extra["stop_reason"] == chat_stop
    chunks = list(client.chat.completions.create(messages=messages, stop=[chat_stop], stream=True, **greedy))
    assert [c.choices[0].model_extra["stop_reason"] for c in chunks if c.choices and c.choices[0].finish_reason] == [
        chat_stop
    ]


def test_return_token_ids_gives_the_prompt_and_output_ids_streamed_or_not(smollm2_server):
    """vLLM's `return_token_ids`: the prompt's ids as /tokenize gives them, the output's as
    many as `completion_tokens` and decoding to the text; a stream's chunks carry the same ids
    in pieces, the prompt's once (per choice on completions, per stream on chat)."""
    client, http = smollm2_server.client(), smollm2_server.http()
    greedy = {"model": "smollm2-135m", "max_tokens": 12, "temperature": 0, "extra_body": {"return_token_ids": True}}
    prompt, messages = "The capital of France is", [{"role": "user", "content": "Name a color."}]
    prompt_ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    chat_prompt_ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]

    done = client.completions.create(prompt=prompt, **greedy).model_dump()
    choice = done["choices"][0]
    assert choice["prompt_token_ids"] == prompt_ids and len(choice["token_ids"]) == done["usage"]["completion_tokens"]
    assert http.post("/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"] == choice["text"]
    chunks = [c.model_dump() for c in client.completions.create(prompt=[prompt, prompt], stream=True, **greedy)]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert [c["prompt_token_ids"] for c in mine if c.get("prompt_token_ids")] == [prompt_ids]
        assert sum((c["token_ids"] for c in mine), []) == choice["token_ids"]

    chat = client.chat.completions.create(messages=messages, **greedy).model_dump()
    assert chat["prompt_token_ids"] == chat_prompt_ids
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    chunks = [c.model_dump() for c in client.chat.completions.create(messages=messages, stream=True, **greedy)]
    assert [c["prompt_token_ids"] for c in chunks if c.get("prompt_token_ids")] == [chat_prompt_ids]
    assert sum((c["choices"][0]["token_ids"] for c in chunks if c["choices"]), []) == chat["choices"][0]["token_ids"]
    plain = client.chat.completions.create(messages=messages, model="smollm2-135m", max_tokens=2).model_dump()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_return_tokens_as_token_ids_names_every_logprob_token_by_its_id(smollm2_server):
    """vLLM's `return_tokens_as_token_ids`: `token_id:<id>` for each sampled token (the ids
    `return_token_ids` gives) and each top-logprob token, on completions and chat."""
    client = smollm2_server.client()
    extra = {"extra_body": {"return_tokens_as_token_ids": True, "return_token_ids": True}}
    greedy = {"model": "smollm2-135m", "max_tokens": 6, "temperature": 0, **extra}
    done = client.completions.create(prompt="The capital of France is", logprobs=2, **greedy).model_dump()
    choice = done["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    for top in choice["logprobs"]["top_logprobs"]:
        assert len(top) == 2 and all(re.fullmatch(r"token_id:\d+", name) for name in top)
    messages = [{"role": "user", "content": "Name a color."}]
    chat = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2, **greedy).model_dump()
    content = chat["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in chat["choices"][0]["token_ids"]]
    assert all(e["bytes"] == list(e["token"].encode()) and len(e["top_logprobs"]) == 2 for e in content)
    assert content[0]["top_logprobs"][0]["token"] == content[0]["token"]  # greedy: the top one was sampled


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(smollm2_server, route):
    """vLLM's `stream_options.continuous_usage_stats`: each chunk's usage counts the tokens
    so far, up to the final usage chunk's; with include_usage alone, chunks carry null."""
    client = smollm2_server.client()
    kw = {"model": "smollm2-135m", "max_tokens": 8, "temperature": 0, "stream": True}
    if route == "chat":
        kw["messages"], create = [{"role": "user", "content": "Name a color."}], client.chat.completions.create
    else:
        kw["prompt"], create = "The capital of France is", client.completions.create
    every = list(create(stream_options={"include_usage": True, "continuous_usage_stats": True}, **kw))
    counts = [c.usage.completion_tokens for c in every if c.choices]
    assert counts == sorted(counts) and counts[-1] == every[-1].usage.completion_tokens == 8
    assert all(c.usage.prompt_tokens == every[-1].usage.prompt_tokens for c in every)
    final_only = list(create(stream_options={"include_usage": True}, **kw))
    assert all(c.usage is None for c in final_only if c.choices)
    assert final_only[-1].usage.completion_tokens == 8  # the prompt's cached share differs on a rerun


def test_a_cache_salt_shares_cached_prompt_prefixes_only_within_the_salt(smollm2_server):
    """vLLM's `cache_salt`: a prompt cached under one salt is a hit again under that salt
    only, not under another salt nor without one (and the unsalted cache stays shared)."""
    client = smollm2_server.client()
    prompt = f"Notes of tenant {uuid.uuid4().hex}: " + "the quick brown fox jumps over the lazy dog. " * 6

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt else {}
        res = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=1, extra_body=extra)
        return res.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0 and cached(None) == 0
    assert cached(None) > 0 and cached("tenant-c") == 0


def test_a_priority_on_a_server_that_does_not_schedule_by_it_is_a_400(smollm2_server):
    """As vLLM: `priority` other than 0 needs `--schedule-policy priority`."""
    body = {"prompt": "Hi", "max_tokens": 1, "priority": 1}
    resp = smollm2_server.http().post("/v1/completions", json=body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "priority", resp.text
    assert "--schedule-policy priority" in resp.json()["error"]["message"]
    assert smollm2_server.http().post("/v1/completions", json={**body, "priority": 0}).status_code == 200


def test_unknown_model_is_404_and_bad_parameter_is_400(smollm2_server):
    client = smollm2_server.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2-135m", prompt="hi", max_tokens=2, temperature=-1)
    assert e.value.body is not None and "temperature" in str(e.value.body)
    assert smollm2_server.client().models.list().data[0].id == "smollm2-135m"


WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Oslo? Use the tool."}]


def _assert_stream_accumulates_to_the_message(client, **kw) -> Any:
    """Greedy, so both runs write the same text: the openai client's own stream accumulation
    (chat.completions.stream) must give the message, calls and finish reason of the
    non-streamed answer, whether the model called a tool or answered."""
    full = client.chat.completions.create(**kw).choices[0]
    with client.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        streamed = stream.current_completion_snapshot.choices[0]  # the final parse refuses `length`

    def calls(message) -> list[tuple[str, str]]:
        return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]

    assert (streamed.message.content or None) == (full.message.content or None)
    assert calls(streamed.message) == calls(full.message)
    assert streamed.finish_reason == full.finish_reason
    return full


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_streamed_chat_with_tools_accumulates_to_the_non_streamed_message(smollm2_server, tool_choice):
    full = _assert_stream_accumulates_to_the_message(
        smollm2_server.client(),
        model="smollm2-135m",
        messages=WEATHER_QUESTION,
        tools=[WEATHER_TOOL],
        tool_choice=tool_choice,
        max_tokens=64,
        temperature=0,
    )
    if tool_choice == "required":
        assert full.finish_reason == "tool_calls" and full.message.tool_calls[0].function.name == "get_weather"


def test_parsers_chosen_by_flag_reach_the_chat_answers():
    """SmolLM2 writes no `<think>`: with a reasoning parser its answer stays content and
    `reasoning_content` is null; with llama3_json the system prompt teaches that format and
    streamed calls or text still add up to the non-streamed answer."""
    with running_server(["--reasoning-parser", "qwen3", "--tool-call-parser", "llama3_json"]) as server:
        client = server.client()
        kw = dict(model="smollm2-135m", messages=WEATHER_QUESTION, max_tokens=24, temperature=0)
        full = _assert_stream_accumulates_to_the_message(client, **kw)
        assert full.message.content and full.message.model_extra["reasoning_content"] is None
        _assert_stream_accumulates_to_the_message(client, **kw, tools=[WEATHER_TOOL], tool_choice="auto")
        # A constraint starts after any thinking: the grammar lets `<think>` free text come
        # first, and SmolLM2, told it reasons, takes it and thinks on to the length limit.
        kw["max_tokens"] = 64
        forced = _assert_stream_accumulates_to_the_message(client, **kw, tools=[WEATHER_TOOL], tool_choice="required")
        if forced.finish_reason == "tool_calls":
            assert forced.message.tool_calls[0].function.name == "get_weather"
        else:
            assert forced.finish_reason == "length" and forced.message.model_extra["reasoning_content"]
            assert not forced.message.content and not forced.message.tool_calls
        as_json = client.chat.completions.create(**kw, response_format={"type": "json_object"})
        if as_json.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(as_json.choices[0].message.content), dict)


def test_a_forced_call_in_qwen3_coders_xml_format_is_served_and_read_back():
    """The grammar makes SmolLM2 write Qwen3-Coder's `<function=...>` block, and the parser
    reads it into a call, streamed or not."""
    with running_server(["--tool-call-parser", "qwen3_coder", "--max-total-tokens", "4096"]) as server:
        client = server.client()
        kw = dict(model="smollm2-135m", messages=WEATHER_QUESTION, max_tokens=48, temperature=0, tools=[WEATHER_TOOL])
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            full = _assert_stream_accumulates_to_the_message(client, **kw, tool_choice=choice)
            assert full.finish_reason == "tool_calls", full
            call = full.message.tool_calls[0].function
            assert call.name == "get_weather" and isinstance(json.loads(call.arguments), dict)
