"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}, GET
/v1/responses/{id}/input_items, and POST /v1/responses/{id}/cancel (background responses).

A request is resolved as the chat completion it means (`ResponsesRequest.chat_request`, then
`openai_request.resolve_chat`), after the conversation of its `previous_response_id` from the
store. Its one choice's text goes through the chat parsers (`chat_output`: reasoning, tool
calls) and becomes output items (`responses_format`): a reasoning item, a message, function
calls. Streamed, each item is announced as it grows, by typed events (`event:` and `data:`
lines, numbered by `sequence_number`); the last event carries the whole response. A response
with `store: true` is kept (`responses_store`) once it ends.

The response's id is `resp_<name>` (`request_id`, the X-Request-Id header, or random): POST
/abort with it stops the response, which then has status `cancelled`. A background response
(`background: true`) is stored `queued` at once and made by a task of `BackgroundResponses`;
it is stored again when its first token comes (`in_progress`) and when it ends.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse

from tokenizer_proc import openai_format as fmt
from tokenizer_proc.chat_output import ChoiceOutput, choice_output
from tokenizer_proc.errors import SERVER_ERROR, APIError
from tokenizer_proc.openai_api import EventStreamResponse, submit_choices
from tokenizer_proc.openai_request import ResolvedChat, request_name, resolve_chat
from tokenizer_proc.request_handle import RequestHandle
from tokenizer_proc.responses_format import (
    ResponseOutput,
    listed_input_items,
    response_body,
    response_status,
    response_usage,
)
from tokenizer_proc.responses_protocol import INPUT_ITEMS, RESPONSES_PARAM, ResponsesRequest
from tokenizer_proc.responses_store import StoredResponse
from tokenizer_proc.sampling import check_model
from tokenizer_proc.serving import CLIENT_CLOSED, ChoiceResult, ClientDisconnected, collect, merge_outputs, typed_sse
from tokenizer_proc.state import FrontendState, get_state

router = APIRouter()

CANCEL_WAIT_S = 10.0
"""How long POST /v1/responses/{id}/cancel waits for the response to store itself cancelled."""


class _Turn:
    """One response being made: what the request resolved to, and what finishing it takes."""

    def __init__(self, st: FrontendState, body: ResponsesRequest, resolved: ResolvedChat, rid: str) -> None:
        self.st, self.body, self.resolved, self.rid = st, body, resolved, rid
        self.created_at = int(time.time())
        self.choice: ChoiceOutput = choice_output(resolved.plan, st.tool_format, st.model_reasons, resolved.prompt_text)
        self.output = ResponseOutput()

    def body_now(self, status: str, **fields: Any) -> dict[str, Any]:
        model = self.st.args.served_model_name
        defaults = self.st.args.sampling_defaults
        return response_body(
            self.rid, self.created_at, model, self.body, status, self.output.items, sampling_defaults=defaults, **fields
        )

    def feed(self, text: str, finish_reason: str | None, result: ChoiceResult, new_tokens: int) -> list[dict[str, Any]]:
        """The events of a piece of the choice's text; `new_tokens`: how many of the result's
        last token ids it holds (their logprobs go with it)."""
        logprobs = None
        if self.body.logprobs_wanted() and new_tokens:
            first = len(result.token_ids) - new_tokens
            logprobs = fmt.chat_logprobs(
                self.st.strings, result.token_ids[first:], result.token_logprobs[first:], result.top_logprobs[first:]
            )["content"]
        return self.output.feed(self.choice.feed(text, finish_reason), logprobs)

    def finish(self, result: ChoiceResult) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The final response object, and the events that close its last item."""
        status, incomplete = response_status(result.finish_reason)
        events = self.output.finish("completed" if status == "completed" else "incomplete")
        reasoning_tokens = (
            len(self.st.tokenizer.encode(self.choice.reasoning_text, add_special_tokens=False))
            if self.choice.reasoning_text
            else 0
        )
        input_tokens = len(self.resolved.prompt_ids)
        usage = response_usage(input_tokens, result.cached_tokens, result.completion_tokens, reasoning_tokens)
        error = None
        if status == "failed":
            error = {"code": SERVER_ERROR, "message": f"generation failed: {result.error or 'unknown error'}"}
        final = self.body_now(status, usage=usage, incomplete_details=incomplete, error=error)
        # A failed response has nothing to continue from; kept only for a background client
        # polling to learn that it failed.
        if self.body.store and (status != "failed" or self.body.background):
            self.store(final)
        return final, events

    def store(self, body: dict[str, Any]) -> None:
        """Keep the response as it stands now (a background one is stored from its start)."""
        self.st.responses.put(
            self.rid,
            StoredResponse(
                body,
                self.body.input_items(),
                INPUT_ITEMS.validate_python(_as_input(self.output.items)),
                self.body.previous_response_id,
                listed_input_items(self.body.input_items()),
            ),
        )


def _as_input(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as a client sends them back as input."""
    out = []
    for item in items:
        if item["type"] == "message":
            out.append({"type": "message", "role": "assistant", "content": item["content"][0]["text"]})
        elif item["type"] == "reasoning":
            out.append({"type": "reasoning", "content": item["content"]})
        else:
            out.append({k: item[k] for k in ("type", "call_id", "name", "arguments")})
    return out


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    st = get_state(request)
    check_model(body.model, st.limits)
    history = st.responses.conversation(body.previous_response_id) if body.previous_response_id else []
    if body.background and (body.stream or not body.store):
        raise APIError(
            "A background response is stored and not streamed: drop `stream`, keep `store`.", param="background"
        )
    chat = body.chat_request(history)
    rid = f"resp_{request_name(chat, request)}"
    try:
        resolved = resolve_chat(st, chat)
        handles = await submit_choices(
            st, resolved.prompt_ids, chat, resolved.sampling, rid, resolved.max_tokens_param, 1
        )
    except APIError as e:  # in the Responses API's words
        raise e.in_words_of(RESPONSES_PARAM) from None
    turn = _Turn(st, body, resolved, rid)
    if body.background:
        queued = turn.body_now("queued")
        turn.store(queued)
        st.background_responses.start(rid, _in_background(turn, handles))
        return JSONResponse(queued)
    if body.stream:
        return EventStreamResponse(_stream(turn, handles), handles)
    try:
        result = (await collect(request, handles))[0]
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    turn.feed(result.text, result.finish_reason, result, len(result.token_ids))
    final, _ = turn.finish(result)
    return JSONResponse(final)


async def _in_background(turn: _Turn, handles: list[RequestHandle]) -> None:
    """A background response made to its end, its stored state `in_progress` from its first
    output; a cancel aborts its handles, and it ends `cancelled`."""
    result = ChoiceResult(0)
    async for out in merge_outputs(handles):
        if not result.token_ids and out.token_ids:
            turn.store(turn.body_now("in_progress"))
        result.add(out)
    turn.feed(result.text, result.finish_reason, result, len(result.token_ids))
    turn.finish(result)


async def _stream(turn: _Turn, handles: list[RequestHandle]) -> AsyncIterator[bytes]:
    output = turn.output
    yield typed_sse(output.event("response.created", response=turn.body_now("in_progress")))
    yield typed_sse(output.event("response.in_progress", response=turn.body_now("in_progress")))
    result = ChoiceResult(0)
    async for out in merge_outputs(handles):
        result.add(out)
        text = "" if out.finish_reason == "error" else out.text
        for event in turn.feed(text, out.finish_reason, result, len(out.token_ids)):
            yield typed_sse(event)
    final, events = turn.finish(result)
    for event in events:
        yield typed_sse(event)
    ending = {
        "completed": "response.completed",
        "incomplete": "response.incomplete",
        "cancelled": "response.incomplete",
        "failed": "response.failed",
    }
    yield typed_sse(output.event(ending[final["status"]], response=final))


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> dict[str, Any]:
    return _stored(get_state(request), response_id).body


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> dict[str, Any]:
    """Stop a background response; one already ended is returned as it ended (as OpenAI's)."""
    st = get_state(request)
    stored = _stored(st, response_id)
    if not stored.body["background"]:
        raise APIError(f"Response {response_id!r} was not made in the background: only such can be cancelled.")
    if st.background_responses.cancel(response_id):
        # The abort ends the task at its next output; a scheduler slow to answer (a restart)
        # must not hold the client: it then sees the response as it stands, and polls.
        await st.background_responses.ended(response_id, CANCEL_WAIT_S)
        stored = _stored(st, response_id)
    return stored.body


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    request: Request,
    after: str | None = None,
    limit: int = Query(20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
) -> dict[str, Any]:
    """The stored response's own input items (not its conversation's), a page at a time."""
    items = _stored(get_state(request), response_id).listed_input
    items = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(f"`after` names no input item of {response_id!r}.", param="after")
        start = ids.index(after) + 1
    page = items[start : start + limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + limit < len(items),
    }


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    st = get_state(request)
    _stored(st, response_id)
    st.responses.delete(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def _stored(st: FrontendState, response_id: str) -> StoredResponse:
    stored = st.responses.get(response_id)
    if stored is None:
        raise APIError(f"Response with id {response_id!r} not found.", 404, param="response_id", code="not_found")
    return stored
