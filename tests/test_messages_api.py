"""Anthropic's Messages API (/v1/messages) through the official `anthropic` client, on the
default model in float32: a message answers as the chat completion of the same conversation
does, streams add up to it, stop reasons and tool use map to Anthropic's, and what is not
served is a 400 in Anthropic's error shape. The block builder is also checked on its own, on
thinking and calls the default model does not write, against the client's own types."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent

from tests.helpers import make_random_llama, running_server
from tokenizer_proc.chat_output import choice_output
from tokenizer_proc.messages_api import ContentBlocks
from tokenizer_proc.tool_parsers import HERMES
from tokenizer_proc.tools import ToolPlan

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
GREEDY = {"extra_body": {"temperature": 0}}
EVENTS = pydantic.TypeAdapter(RawMessageStreamEvent)


@pytest.fixture(scope="module")
def client(smollm2_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=smollm2_server.base_url, api_key="unused", max_retries=0)


def _prompt_tokens(message: Any) -> int:
    return message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_a_message_answers_as_the_chat_completion_of_its_conversation(client, smollm2_server):
    message = client.messages.create(model=MODEL, max_tokens=40, messages=QUESTION, system="Be brief.", **GREEDY)
    chat = smollm2_server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}, *QUESTION], max_tokens=40, temperature=0
    )
    assert [block.type for block in message.content] == ["text"] and message.stop_reason == "end_turn"
    assert message.content[0].text == chat.choices[0].message.content and "Paris" in message.content[0].text
    assert _prompt_tokens(message) == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens
    assert message.usage.cache_creation_input_tokens == 0 and message.model == MODEL and message.role == "assistant"
    # The same prompt again is read from the prefix cache, and the usage says so.
    again = client.messages.create(model=MODEL, max_tokens=40, messages=QUESTION, system="Be brief.", **GREEDY)
    assert again.usage.cache_read_input_tokens > 0 and _prompt_tokens(again) == _prompt_tokens(message)


def test_a_streamed_message_adds_up_to_the_message_made_without_streaming(client, smollm2_server):
    kw = {"model": MODEL, "max_tokens": 60, "messages": [{"role": "user", "content": "Name three colors."}], **GREEDY}
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    assert [b.text for b in streamed.content] == [b.text for b in whole.content]
    assert streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    # The raw events, each one the client's types accept to the letter.
    body = {"max_tokens": 60, "messages": kw["messages"], "temperature": 0, "stream": True}
    with smollm2_server.http().stream("POST", "/v1/messages", json=body) as response:
        lines = list(response.iter_lines())
    events = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert [line.removeprefix("event: ") for line in lines if line.startswith("event: ")] == [e["type"] for e in events]
    for event in events:
        if event["type"] != "ping":  # the client reads pings apart from the message events
            EVENTS.validate_python(event)
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    deltas = [e["delta"]["text"] for e in events if e["type"] == "content_block_delta"]
    assert len(deltas) > 3 and "".join(deltas) == whole.content[0].text


def test_max_tokens_and_stop_sequences_give_anthropics_stop_reasons(client):
    prompt = [{"role": "user", "content": "Write a short poem about the sea."}]
    free = client.messages.create(model=MODEL, max_tokens=30, messages=prompt, **GREEDY)
    cut = client.messages.create(model=MODEL, max_tokens=3, messages=prompt, **GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3 and cut.stop_sequence is None
    text = free.content[0].text
    stop = text.split()[2]
    stops = ["zzz", stop]
    stopped = client.messages.create(model=MODEL, max_tokens=30, messages=prompt, stop_sequences=stops, **GREEDY)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == text[: text.index(stop)]
    with client.messages.stream(model=MODEL, max_tokens=30, messages=prompt, stop_sequences=[stop], **GREEDY) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    assert final.content[0].text == stopped.content[0].text


def test_a_tool_use_and_its_result_round_trip_as_chat_tool_calls(client, smollm2_server):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    called = client.messages.create(model=MODEL, max_tokens=60, messages=ask, **forced, **GREEDY)
    assert called.stop_reason == "tool_use" and [b.type for b in called.content] == ["tool_use"]
    use = called.content[0]
    assert use.name == "get_weather" and set(use.input) == {"city"}
    with client.messages.stream(model=MODEL, max_tokens=60, messages=ask, **forced, **GREEDY) as stream:
        streamed = stream.get_final_message()  # the client parses the input_json_delta pieces
    assert streamed.content[0].input == use.input and streamed.stop_reason == "tool_use"
    # The client runs the tool and sends its result: the model reads it as chat's tool message.
    answered = client.messages.create(
        model=MODEL, max_tokens=30, tools=[WEATHER], **GREEDY,
        messages=[
            *ask,
            {"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C."}]},
        ],
    )  # fmt: skip
    chat = smollm2_server.client().chat.completions.create(
        model=MODEL, max_tokens=30, temperature=0,
        tools=[{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                 "parameters": WEATHER["input_schema"]}}],
        messages=[
            *ask,
            {"role": "assistant", "tool_calls": [{"id": use.id, "type": "function",
                                                  "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
            {"role": "tool", "tool_call_id": use.id, "content": "Sunny, 21 C."},
        ],
    )  # fmt: skip
    assert _prompt_tokens(answered) == chat.usage.prompt_tokens
    assert answered.content[0].text == chat.choices[0].message.content


def test_anthropics_client_lists_and_retrieves_the_served_model(client, smollm2_server):
    (listed,) = list(client.models.list())
    assert listed.id == MODEL and listed.type == "model" and listed.display_name == MODEL
    assert client.models.retrieve(MODEL).id == MODEL
    openai_listed = smollm2_server.client().models.list().data
    assert [m.id for m in openai_listed] == [MODEL] and openai_listed[0].owned_by == "trident"


def test_count_tokens_counts_the_prompt_a_message_reads(client):
    for kw in ({"messages": QUESTION, "system": "Be brief."}, {"messages": QUESTION, "tools": [WEATHER]}):
        counted = client.messages.count_tokens(model=MODEL, **kw)
        made = client.messages.create(model=MODEL, max_tokens=1, **kw)
        assert counted.input_tokens == _prompt_tokens(made) > 0
    with_tools = client.messages.count_tokens(model=MODEL, messages=QUESTION, tools=[WEATHER]).input_tokens
    assert with_tools > client.messages.count_tokens(model=MODEL, messages=QUESTION).input_tokens


@pytest.mark.parametrize(
    "body, field",
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "redacted_thinking", "data": "x"}]}]}, "messages"),
        ({"messages": QUESTION, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
        ({"messages": QUESTION, "tool_choice": {"type": "tool"}}, "tool_choice"),
        ({"messages": QUESTION, "tool_choice": {"type": "tool", "name": "get_weather"}}, "tool_choice"),
        ({"messages": QUESTION, "temperature": 1.5}, "temperature"),
        ({"messages": QUESTION, "stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
        ({"messages": QUESTION, "container": "x"}, "container"),
        ({"messages": []}, "messages"),
        ({"messages": QUESTION, "model": "claude-sonnet"}, "model"),
    ],
)
def test_what_the_messages_api_does_not_serve_is_a_400_in_anthropics_shape(smollm2_server, body, field):
    answer = smollm2_server.http().post("/v1/messages", json={"max_tokens": 8, **body})
    expected = 404 if field == "model" else 400
    assert answer.status_code == expected, answer.text
    error = answer.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == ("not_found_error" if expected == 404 else "invalid_request_error")
    assert field in error["error"]["message"], error


def test_thinking_text_and_tool_use_become_blocks_in_order_whatever_the_pieces():
    text = (
        "<think>The user wants weather.</think>\nLet me check.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )

    def blocks_of(pieces: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        choice = choice_output(ToolPlan([{"name": "get_weather"}], "auto"), HERMES, True, "")
        blocks = ContentBlocks()
        events = []
        for i, piece in enumerate(pieces):
            events += blocks.feed(choice.feed(piece, "stop" if i == len(pieces) - 1 else None))
        return events + blocks.close(), blocks.content

    _, whole = blocks_of([text])
    events, pieces = blocks_of([text[i : i + 3] for i in range(0, len(text), 3)])
    assert [b["type"] for b in whole] == ["thinking", "text", "tool_use"]
    assert whole[0]["thinking"] == "The user wants weather." and whole[1]["text"].strip() == "Let me check."
    assert whole[2]["input"] == {"city": "Oslo"} and whole[2]["name"] == "get_weather"
    assert [{k: v for k, v in b.items() if k != "id"} for b in pieces] == [
        {k: v for k, v in b.items() if k != "id"} for b in whole
    ]
    parsed = [EVENTS.validate_python(e) for e in events]
    partial_json = "".join(e.delta.partial_json for e in parsed if e.type == "content_block_delta" and e.index == 2)
    assert json.loads(partial_json) == {"city": "Oslo"}
    assert [e.index for e in parsed if e.type == "content_block_stop"] == [0, 1, 2]
    Message.model_validate(
        {"id": "msg_x", "type": "message", "role": "assistant", "model": MODEL, "content": pieces,
         "stop_reason": "tool_use", "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}
    )  # fmt: skip


def test_a_server_answers_to_each_of_its_names_as_claude_code_needs(tmp_path):
    """vLLM's `--served-model-name a b ...`: a tool that sends its own model names (Claude
    Code's sonnet and haiku) is served under each; OpenAI routes answer with the first."""
    model = make_random_llama(str(tmp_path / "tiny"))
    names = ["tiny", "claude-sonnet-4-5", "claude-haiku-4-5"]
    with running_server(["--model", model, "--served-model-name", *names, "--max-total-tokens", "2048"]) as server:
        client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
        for name in names[1:]:
            message = client.messages.create(model=name, max_tokens=2, messages=QUESTION)
            assert message.model == name and message.usage.output_tokens <= 2
        assert [m.id for m in client.models.list()] == names
        completion = server.client().completions.create(model=names[2], prompt="Hi", max_tokens=1)
        assert completion.model == "tiny"
        with pytest.raises(anthropic.NotFoundError) as unknown:
            client.messages.create(model="claude-opus", max_tokens=2, messages=QUESTION)
        assert all(name in unknown.value.body["error"]["message"] for name in names)
