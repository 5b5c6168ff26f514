"""OpenAI's Responses API (/v1/responses) through the official `openai` client, on the default
model in float32: a response answers as the chat completion of the same conversation does,
stored responses continue conversations, streams add up to the response, and what is not
served is a 400 naming its field. The event builder is also checked on its own, on reasoning
and calls the default model does not write, against the client's own event types."""

from __future__ import annotations

import json
from typing import Any

import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent

from tests.helpers import wait_until
from tokenizer_proc.chat_output import choice_output
from tokenizer_proc.errors import APIError
from tokenizer_proc.responses_format import ResponseOutput
from tokenizer_proc.responses_protocol import MessageItem
from tokenizer_proc.responses_store import ResponseStore, StoredResponse
from tokenizer_proc.tool_parsers import HERMES
from tokenizer_proc.tools import ToolPlan

MODEL = "smollm2-135m"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


def _chat(client: openai.OpenAI, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def test_a_response_answers_as_the_chat_completion_of_its_conversation(smollm2_server):
    client = smollm2_server.client()
    response = client.responses.create(
        model=MODEL, input="What is the capital of France?", instructions="Answer in one sentence.",
        temperature=0, max_output_tokens=40,
    )  # fmt: skip
    chat = _chat(
        client,
        [
            {"role": "system", "content": "Answer in one sentence."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        max_completion_tokens=40,
    )
    assert response.status == "completed" and response.incomplete_details is None
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == chat.choices[0].message.content and "Paris" in response.output_text
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.instructions == "Answer in one sentence." and response.model == MODEL


def test_previous_response_id_continues_the_stored_conversation_without_its_instructions(smollm2_server):
    client = smollm2_server.client()
    first = client.responses.create(
        model=MODEL,
        input="What is the capital of France?",
        instructions="Be brief.",
        temperature=0,
        max_output_tokens=30,
    )
    second = client.responses.create(
        model=MODEL, input="And of Germany?", previous_response_id=first.id, temperature=0, max_output_tokens=30
    )
    chat = _chat(
        client,
        [
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And of Germany?"},
        ],
        max_completion_tokens=30,
    )
    assert second.previous_response_id == first.id
    assert second.output_text == chat.choices[0].message.content and "Berlin" in second.output_text
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    # A third turn reaches back through both; the earlier turns are read from the prefix cache.
    third = client.responses.create(
        model=MODEL, input="And of Italy?", previous_response_id=second.id, temperature=0, max_output_tokens=30
    )
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    assert third.usage.input_tokens_details.cached_tokens > 0


def test_a_stored_response_is_retrieved_until_it_is_deleted_and_an_unstored_one_never_is(smollm2_server):
    client, http = smollm2_server.client(), smollm2_server.http()
    kept = client.responses.create(model=MODEL, input="Say hello.", temperature=0, max_output_tokens=8)
    assert client.responses.retrieve(kept.id).model_dump() == kept.model_dump()
    client.responses.delete(kept.id)
    for response_id in (kept.id, client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=2).id):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response_id)
        missing = http.post("/v1/responses", json={"input": "Hi", "previous_response_id": response_id})
        assert missing.status_code == 400
        assert missing.json()["error"]["code"] == "previous_response_not_found"
        assert missing.json()["error"]["param"] == "previous_response_id"
    assert http.delete("/v1/responses/resp_never").status_code == 404


def test_a_stored_responses_input_items_are_listed_a_page_at_a_time(smollm2_server):
    client, http = smollm2_server.client(), smollm2_server.http()
    conversation = [
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a color."}]},
    ]
    response = client.responses.create(model=MODEL, input=conversation, max_output_tokens=4, instructions="Be brief.")
    listed = list(client.responses.input_items.list(response.id, order="asc"))  # the client pages through
    assert [(i.type, i.role) for i in listed] == [("message", "user"), ("message", "assistant"), ("message", "user")]
    assert [i.content[0].text for i in listed] == ["Hello.", "Hello! How can I help?", "Name a color."]
    assert len({i.id for i in listed}) == 3  # ids given once, the same on every listing
    first_page = http.get(f"/v1/responses/{response.id}/input_items", params={"limit": 2}).json()
    assert [i["id"] for i in first_page["data"]] == [listed[2].id, listed[1].id] and first_page["has_more"]
    rest = http.get(
        f"/v1/responses/{response.id}/input_items", params={"limit": 2, "after": first_page["last_id"]}
    ).json()
    assert [i["id"] for i in rest["data"]] == [listed[0].id] and not rest["has_more"]
    for item in first_page["data"] + rest["data"]:
        pydantic.TypeAdapter(ResponseItem).validate_python(item)
    assert http.get("/v1/responses/resp_never/input_items").status_code == 404
    assert http.get(f"/v1/responses/{response.id}/input_items", params={"after": "msg_never"}).status_code == 400
    assert http.get(f"/v1/responses/{response.id}/input_items", params={"limit": 0}).status_code == 400


def _streamed(client: openai.OpenAI, **kw: Any) -> tuple[list[Any], Any]:
    """The stream's events, parsed by the client; and its last event's response."""
    events = list(client.responses.create(model=MODEL, stream=True, **kw))
    return events, events[-1].response


def test_a_streamed_response_adds_up_to_the_response_made_without_streaming(smollm2_server):
    client = smollm2_server.client()
    kw = {"input": "Name three colors.", "temperature": 0, "max_output_tokens": 60}
    whole = client.responses.create(model=MODEL, **kw)
    events, final = _streamed(client, **kw)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 3 and "".join(deltas) == whole.output_text == final.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert final.status == "completed" and final.usage.output_tokens == whole.usage.output_tokens
    # The SDK's own accumulation of the events agrees.
    with client.responses.stream(model=MODEL, **kw) as stream:
        assert stream.get_final_response().output_text == whole.output_text


def test_a_response_cut_by_max_output_tokens_is_incomplete_streamed_or_not(smollm2_server):
    client = smollm2_server.client()
    kw = {"input": "Write a long story about a dragon.", "max_output_tokens": 5, "temperature": 0}
    cut = client.responses.create(model=MODEL, **kw)
    events, final = _streamed(client, **kw)
    for response in (cut, final):
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
        assert response.usage.output_tokens == 5 and response.output[0].status == "incomplete"
    assert events[-1].type == "response.incomplete" and final.output_text == cut.output_text


def test_a_function_call_and_its_output_round_trip_as_chat_tool_calls(smollm2_server):
    client = smollm2_server.client()
    kw = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0}
    called = client.responses.create(model=MODEL, input="What is the weather in Paris?", max_output_tokens=60, **kw)
    assert [item.type for item in called.output] == ["function_call"] and called.status == "completed"
    call = called.output[0]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"} and call.status == "completed"
    # Streamed, the call's arguments arrive as deltas that add up to the same call.
    events, final = _streamed(client, input="What is the weather in Paris?", max_output_tokens=60, **kw)
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == final.output[0].arguments == call.arguments
    # The client runs the function and sends its output back: the model reads it as chat's tool message.
    function = {"name": call.name, "arguments": call.arguments}
    answered = client.responses.create(
        model=MODEL, previous_response_id=called.id, tools=[WEATHER], temperature=0, max_output_tokens=30,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."}],
    )  # fmt: skip
    chat = _chat(
        client,
        [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function", "function": function}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C."},
        ],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        max_completion_tokens=30,
    )  # fmt: skip
    assert answered.usage.input_tokens == chat.usage.prompt_tokens
    assert answered.output_text == (chat.choices[0].message.content or "")


def test_text_format_constrains_the_output_to_its_json_schema(smollm2_server):
    client = smollm2_server.client()
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    response = client.responses.create(
        model=MODEL, input="Is Paris in France? Answer in JSON.", temperature=0, max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "verdict", "schema": schema}},
    )  # fmt: skip
    assert json.loads(response.output_text)["answer"] in ("yes", "no")
    assert response.text.format.type == "json_schema"


def test_output_text_logprobs_come_when_included(smollm2_server):
    client = smollm2_server.client()
    response = client.responses.create(
        model=MODEL, input="Say hi.", temperature=0, max_output_tokens=6,
        include=["message.output_text.logprobs"], top_logprobs=2,
    )  # fmt: skip
    logprobs = response.output[0].content[0].logprobs
    assert "".join(lp.token for lp in logprobs) == response.output_text and len(logprobs) == 6
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)
    assert all(lp.top_logprobs[0].logprob == lp.logprob for lp in logprobs)  # greedy: the top token is the one chosen
    events, final = _streamed(client, input="Say hi.", temperature=0, max_output_tokens=6,
                              include=["message.output_text.logprobs"], top_logprobs=2)  # fmt: skip
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in logprobs]
    assert not client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=2).output[0].content[0].logprobs


def test_aborting_a_response_by_its_id_ends_it_cancelled(smollm2_server):
    http = smollm2_server.http()
    body = {
        "input": "Count to a thousand.",
        "max_output_tokens": 2000,
        "ignore_eos": True,
        "request_id": "to-abort",
        "stream": True,
    }
    with http.stream("POST", "/v1/responses", json=body, timeout=120) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if "response.output_text.delta" in line)
        assert wait_until(lambda: http.post("/abort", json={"rid": "resp_to-abort"}).json()["aborted"], 30)
        last = [line for line in lines if line.startswith("data: ")][-1]
    final = json.loads(last.removeprefix("data: "))
    assert final["type"] == "response.incomplete" and final["response"]["status"] == "cancelled"
    assert final["response"]["usage"]["output_tokens"] < 2000


def test_a_background_response_is_queued_at_once_then_polled_to_the_foregrounds_text(smollm2_server):
    client = smollm2_server.client(timeout=120)
    ask = {"model": MODEL, "input": "Name three colors.", "max_output_tokens": 12, "temperature": 0}
    queued = client.responses.create(**ask, background=True)
    assert queued.status == "queued" and queued.background and not queued.output
    Response.model_validate(smollm2_server.http().get(f"/v1/responses/{queued.id}").json(), strict=True)
    assert wait_until(lambda: client.responses.retrieve(queued.id).status == "completed", 120)
    done = client.responses.retrieve(queued.id)
    assert done.output_text == client.responses.create(**ask, store=False).output_text
    assert done.background and done.usage.output_tokens > 0
    follow = client.responses.create(
        model=MODEL, input="And one more.", previous_response_id=queued.id, max_output_tokens=4
    )
    assert follow.status in ("completed", "incomplete")
    # Cancelling a response that has ended gives it back as it ended.
    assert client.responses.cancel(queued.id).status == "completed"


def test_cancelling_a_background_response_ends_it_cancelled_and_nothing_continues_it_before(smollm2_server):
    client = smollm2_server.client(timeout=120)
    long = {"model": MODEL, "input": "Count to a thousand.", "max_output_tokens": 2000, "temperature": 0}
    queued = client.responses.create(**long, background=True, extra_body={"ignore_eos": True})
    with pytest.raises(openai.BadRequestError, match="still being made") as refused:
        client.responses.create(model=MODEL, input="Go on.", previous_response_id=queued.id)
    assert refused.value.body["param"] == "previous_response_id"
    assert wait_until(lambda: client.responses.retrieve(queued.id).status == "in_progress", 60)
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and cancelled.usage.output_tokens < 2000
    assert client.responses.retrieve(queued.id).status == "cancelled"
    foreground = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="not made in the background"):
        client.responses.cancel(foreground.id)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "Hi", "background": True, "stream": True}, "background"),
        ({"input": "Hi", "background": True, "store": False}, "background"),
        ({"input": "Hi", "truncation": "auto"}, "truncation"),
        (
            {
                "input": [
                    {"type": "reasoning", "summary": [], "encrypted_content": "abc"},
                    {"role": "user", "content": "Hi"},
                ]
            },
            "input",
        ),
        ({"input": "Hi", "include": ["file_search_call.results"]}, "include"),
        ({"input": "Hi", "max_tool_calls": 2}, "max_tool_calls"),
        ({"input": []}, "input"),
        ({"input": "Hi", "tool_choice": {"type": "function", "name": "get_weather"}}, "tool_choice"),
        ({"input": "Hi", "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text"),
        ({"input": "Hi", "max_output_tokens": 10**6}, "max_output_tokens"),
    ],
)
def test_what_the_responses_api_does_not_serve_is_a_400_naming_its_field(smollm2_server, body, param):
    answer = smollm2_server.http().post("/v1/responses", json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param, answer.json()


def _events_and_items(pieces: list[str], prompt: str = "") -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Feed a reasoning model's text with a tool (hermes calls) through the chat parsers into
    the event builder, piece by piece."""
    choice = choice_output(ToolPlan([{"name": "get_weather"}], "auto"), HERMES, True, prompt)
    output = ResponseOutput()
    events = []
    for i, piece in enumerate(pieces):
        events += output.feed(choice.feed(piece, "stop" if i == len(pieces) - 1 else None))
    events += output.finish("completed")
    return events, output.items


def test_reasoning_text_and_calls_become_items_in_order_whatever_the_pieces():
    text = (
        "<think>The user wants weather.</think>\nLet me check.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    _, whole = _events_and_items([text])
    assert [i["type"] for i in whole] == ["reasoning", "message", "function_call"]
    assert whole[0]["content"] == [{"type": "reasoning_text", "text": "The user wants weather."}]
    assert whole[1]["content"][0]["text"].strip() == "Let me check."
    assert json.loads(whole[2]["arguments"]) == {"city": "Oslo"} and whole[2]["name"] == "get_weather"
    events, pieces = _events_and_items([text[i : i + 3] for i in range(0, len(text), 3)])

    def without_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]

    assert without_ids(pieces) == without_ids(whole)
    # Every event is one the official client parses, numbered in order, and an item's
    # deltas add up to it.
    parsed = [EVENTS.validate_python(e) for e in events]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    reasoning = "".join(e.delta for e in parsed if e.type == "response.reasoning_text.delta")
    arguments = "".join(e.delta for e in parsed if e.type == "response.function_call_arguments.delta")
    assert reasoning == "The user wants weather." and arguments == pieces[2]["arguments"]
    done = [e.item.type for e in parsed if e.type == "response.output_item.done"]
    assert done == ["reasoning", "message", "function_call"]
    Response.model_validate(
        {"id": "resp_x", "object": "response", "created_at": 0, "model": MODEL, "output": pieces,
         "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}
    )  # fmt: skip


def test_served_responses_and_events_are_the_official_clients_types_to_the_letter(smollm2_server):
    """The client parses leniently; here every response and event must validate strictly."""
    http = smollm2_server.http()
    bodies = [
        {"input": "Hi", "max_output_tokens": 4},
        {"input": "Weather in Oslo?", "tools": [WEATHER], "tool_choice": "required", "max_output_tokens": 40},
    ]
    for body in bodies:
        Response.model_validate(http.post("/v1/responses", json=body).json())
        with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as stream:
            lines = list(stream.iter_lines())
        events = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
        names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
        assert names == [e["type"] for e in events] and len(events) > 5
        for event in events:
            EVENTS.validate_python(event)


def _stored(text: str, previous: str | None = None) -> StoredResponse:
    return StoredResponse({"text": text}, [MessageItem(role="user", content=text)], [], previous, [])


def test_the_store_forgets_the_least_recently_used_past_its_count_or_its_bytes():
    store = ResponseStore(capacity=2, max_bytes=10**6)
    for rid in ("a", "b"):
        store.put(rid, _stored(rid))
    assert store.get("a") is not None  # a is now the most recently used
    store.put("c", _stored("c"))
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    one = _stored("x" * 1000).size()
    sized = ResponseStore(capacity=100, max_bytes=int(2.5 * one))
    for rid in "pqr":
        sized.put(rid, _stored("x" * 1000))
    assert sized.get("p") is None and sized.get("q") and sized.get("r") and sized.bytes == 2 * one
    sized.put("huge", _stored("x" * 10_000))  # larger than the whole budget: not stored, nothing lost
    assert sized.get("huge") is None and sized.get("q") and sized.bytes == 2 * one
    assert sized.delete("q") and not sized.delete("q") and sized.bytes == one


def test_a_conversation_through_a_forgotten_turn_is_a_400_naming_it():
    store = ResponseStore(capacity=10)
    store.put("t1", _stored("one"))
    store.put("t2", _stored("two", "t1"))
    store.put("t3", _stored("three", "t2"))
    assert [item.text() for item in store.conversation("t3")] == ["one", "two", "three"]
    store.delete("t1")
    with pytest.raises(APIError) as lost:
        store.conversation("t3")
    assert lost.value.code == "previous_response_not_found" and "'t1'" in lost.value.message
    store.put("loop", _stored("again", "loop"))  # a request_id reused as its own previous response
    assert [item.text() for item in store.conversation("loop")] == ["again"]
