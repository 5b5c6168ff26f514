"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

A request is resolved as the chat completion it means (`MessagesRequest.chat_request`, then
`openai_request.resolve_chat`). Its one choice's text goes through the chat parsers
(`chat_output`: reasoning, tool calls) and becomes content blocks (`output_blocks`):
`thinking`, `text`, `tool_use`. Streamed, the blocks go out as Anthropic's events
(`message_start`, `content_block_start`/`_delta`/`_stop`, `message_delta` with the stop
reason and usage, `message_stop`). Errors on these routes have Anthropic's shape (`errors`).

The usage splits the prompt as Anthropic does: `input_tokens` are those computed,
`cache_read_input_tokens` those the radix cache held; nothing is written to a cache on
request, so `cache_creation_input_tokens` is 0.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from tokenizer_proc.chat_output import ChoiceOutput, choice_output
from tokenizer_proc.errors import APIError
from tokenizer_proc.messages_protocol import MESSAGES_PARAM, CountTokensRequest, MessagesRequest
from tokenizer_proc.openai_api import EventStreamResponse, submit_choices
from tokenizer_proc.openai_request import request_name, resolve_chat
from tokenizer_proc.output_blocks import CALL, REASONING, TEXT, OutputBlocks
from tokenizer_proc.request_handle import RequestHandle
from tokenizer_proc.sampling import check_model
from tokenizer_proc.serving import CLIENT_CLOSED, ChoiceResult, ClientDisconnected, collect, merge_outputs, typed_sse
from tokenizer_proc.state import get_state

router = APIRouter()


class ContentBlocks(OutputBlocks):
    """An answer's content blocks so far, and the stream events that build them."""

    def __init__(self) -> None:
        super().__init__()
        self.content: list[dict[str, Any]] = []

    def opened(self, kind: str, call: dict[str, Any] | None) -> list[dict[str, Any]]:
        if kind == CALL:
            assert call is not None
            name = call["function"]["name"]
            block: dict[str, Any] = {"type": "tool_use", "id": call["id"], "name": name, "input": {}}
        elif kind == REASONING:
            block = {"type": "thinking", "thinking": "", "signature": ""}
        else:
            block = {"type": "text", "text": ""}
        self.content.append(block)
        return [{"type": "content_block_start", "index": len(self.content) - 1, "content_block": dict(block)}]

    def written(self, kind: str, text: str) -> list[dict[str, Any]]:
        delta = {
            TEXT: {"type": "text_delta", "text": text},
            REASONING: {"type": "thinking_delta", "thinking": text},
            CALL: {"type": "input_json_delta", "partial_json": text},
        }[kind]
        return [{"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}]

    def closed(self, kind: str, text: str) -> list[dict[str, Any]]:
        block = self.content[-1]
        if kind == CALL:
            block["input"] = _call_input(text)
        else:
            block["thinking" if kind == REASONING else "text"] = text
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]


def _call_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's `input` is; arguments cut off by the
    length limit (not an object yet) give an empty one."""
    try:
        parsed = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _stop(output: ChoiceOutput, result: ChoiceResult) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished answer."""
    if result.finish_reason == "length":
        return "max_tokens", None
    if output.finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(result.stop_reason, str):
        return "stop_sequence", result.stop_reason
    return "end_turn", None


def _usage(prompt_tokens: int, result: ChoiceResult) -> dict[str, int]:
    return {
        "input_tokens": prompt_tokens - result.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": result.cached_tokens,
        "output_tokens": result.completion_tokens,
    }


@router.post("/v1/messages", response_model=None)
async def create_message(body: MessagesRequest, request: Request) -> Response:
    st = get_state(request)
    check_model(body.model, st.limits)
    chat = body.chat_request()
    mid = f"msg_{request_name(chat, request)}"
    try:
        resolved = resolve_chat(st, chat)
        handles = await submit_choices(st, resolved.prompt_ids, chat, resolved.sampling, mid, "max_tokens", 1)
    except APIError as e:  # in the Messages API's words
        raise e.in_words_of(MESSAGES_PARAM) from None
    output = choice_output(resolved.plan, st.tool_format, st.model_reasons, resolved.prompt_text)
    model = body.model or st.args.served_model_name
    if body.stream:
        return EventStreamResponse(_stream(mid, model, len(resolved.prompt_ids), output, handles), handles)
    try:
        result = (await collect(request, handles))[0]
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    blocks = ContentBlocks()
    blocks.feed(output.feed(result.text, result.finish_reason))
    blocks.close()
    stop_reason, stop_sequence = _stop(output, result)
    message = _message(mid, model, blocks.content, stop_reason, stop_sequence)
    return JSONResponse({**message, "usage": _usage(len(resolved.prompt_ids), result)})


def _message(
    mid: str, model: str, content: list[dict[str, Any]], stop_reason: str | None, stop_sequence: str | None
) -> dict[str, Any]:
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
    }


async def _stream(
    mid: str, model: str, prompt_tokens: int, output: ChoiceOutput, handles: list[RequestHandle]
) -> AsyncIterator[bytes]:
    start = {**_message(mid, model, [], None, None), "usage": _usage(prompt_tokens, ChoiceResult(0))}
    yield typed_sse({"type": "message_start", "message": start})
    yield typed_sse({"type": "ping"})
    blocks = ContentBlocks()
    result = ChoiceResult(0)
    async for out in merge_outputs(handles):
        result.add(out)
        if out.finish_reason == "error":
            error = {"type": "api_error", "message": f"generation failed: {out.error or 'unknown error'}"}
            yield typed_sse({"type": "error", "error": error})
            return
        for event in blocks.feed(output.feed(out.text, out.finish_reason)):
            yield typed_sse(event)
    for event in blocks.close():
        yield typed_sse(event)
    stop_reason, stop_sequence = _stop(output, result)
    delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
    yield typed_sse({"type": "message_delta", "delta": delta, "usage": _usage(prompt_tokens, result)})
    yield typed_sse({"type": "message_stop"})


@router.post("/v1/messages/count_tokens", response_model=None)
async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
    """The prompt's tokens, as the model would read them (its template, tools included)."""
    st = get_state(request)
    check_model(body.model, st.limits)
    try:
        resolved = resolve_chat(st, body.chat_request())
    except APIError as e:
        raise e.in_words_of(MESSAGES_PARAM) from None
    return {"input_tokens": len(resolved.prompt_ids)}
