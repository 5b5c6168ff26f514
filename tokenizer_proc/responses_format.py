"""The shapes /v1/responses answers with: output items, the response object, stream events.

One `ResponseOutput` turns a choice's deltas into output items (`output_blocks`: one item a
block), and into the events that announce them as they grow: an item is added, its text
grows by deltas, and it is done when the next kind of output begins or the response ends.
A non-streamed response feeds the same object its whole text once and keeps the items, so
both answers agree.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

from tokenizer_proc.output_blocks import CALL, REASONING, TEXT, OutputBlocks
from tokenizer_proc.responses_protocol import ResponsesRequest


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseOutput(OutputBlocks):
    """A response's output items so far, and its stream's sequence numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.items: list[dict[str, Any]] = []
        """The output items; the open one (if any) is the last."""
        self._logprobs: list[dict[str, Any]] = []
        """The open message's token logprobs so far."""
        self._pending_logprobs: list[dict[str, Any]] = []
        """Logprobs of tokens whose text was held back, sent with the next text delta."""
        self._item_status = "completed"
        self._sequence = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """A stream event, numbered in the order it is sent."""
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def feed(self, delta: dict[str, Any], logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """The events of one choice delta; `logprobs`: its tokens' (chat's `content` entries)."""
        self._pending_logprobs += logprobs or []
        return super().feed(delta)

    def finish(self, status: str) -> list[dict[str, Any]]:
        """The events that close the open item, `status` that of the response's items. Only
        output text has logprobs: those of a call's tokens are not shown."""
        self._item_status = status
        return self.close()

    def opened(self, kind: str, call: dict[str, Any] | None) -> list[dict[str, Any]]:
        if kind == CALL:
            assert call is not None
            item = {
                "id": _new_id("fc"),
                "type": "function_call",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": "",
                "status": "in_progress",
            }
        else:
            item = _message() if kind == TEXT else _reasoning()
        self.items.append(item)
        self._logprobs = []
        events = [self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))]
        part = self._part(kind, "")
        if part is not None:
            events.append(self.event("response.content_part.added", **self._where(), content_index=0, part=part))
        return events

    def written(self, kind: str, text: str) -> list[dict[str, Any]]:
        where = self._where()
        if kind == REASONING:
            return [self.event("response.reasoning_text.delta", **where, content_index=0, delta=text)]
        if kind == CALL:
            return [self.event("response.function_call_arguments.delta", **where, delta=text)]
        logprobs, self._pending_logprobs = self._pending_logprobs, []
        self._logprobs += logprobs
        return [self.event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=logprobs)]

    def closed(self, kind: str, text: str) -> list[dict[str, Any]]:
        item, where = self.items[-1], self._where()
        events: list[dict[str, Any]] = []
        if kind == TEXT:
            self._logprobs += self._pending_logprobs
            self._pending_logprobs = []
            events.append(
                self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=self._logprobs)
            )
        elif kind == REASONING:
            events.append(self.event("response.reasoning_text.done", **where, content_index=0, text=text))
        else:
            item["arguments"] = text
            events.append(self.event("response.function_call_arguments.done", **where, arguments=text))
        part = self._part(kind, text)
        if part is not None:
            item["content"] = [part]
            events.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        item["status"] = self._item_status
        events.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        return events

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _part(self, kind: str, text: str) -> dict[str, Any] | None:
        """An item's content part holding `text` (a call has none)."""
        if kind == TEXT:
            return {"type": "output_text", "text": text, "annotations": [], "logprobs": self._logprobs}
        if kind == REASONING:
            return {"type": "reasoning_text", "text": text}
        return None


def _message() -> dict[str, Any]:
    return {"id": _new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}


def _reasoning() -> dict[str, Any]:
    return {"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}


_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def listed_input_items(items: list[Any]) -> list[dict[str, Any]]:
    """A request's input items as GET /v1/responses/{id}/input_items lists them: each with an
    id (the client's, else a new one) and its text as content parts."""
    listed = []
    for item in items:
        entry = item.model_dump(exclude_none=True, by_alias=True)
        entry["id"] = entry.get("id") or _new_id(_ID_PREFIX[item.type])
        entry["status"] = entry.get("status") or "completed"
        if item.type == "message" and isinstance(item.content, str):
            if item.role == "assistant":
                entry["content"] = [{"type": "output_text", "text": item.content, "annotations": []}]
            else:
                entry["content"] = [{"type": "input_text", "text": item.content}]
        listed.append(entry)
    return listed


def response_status(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """(status, incomplete_details) of a response whose choice ended with `finish_reason`."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "cancelled", None
    if finish_reason == "error":
        return "failed", None
    return "completed", None


def response_usage(input_tokens: int, cached_tokens: int, output_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
    """The radix cache keeps every prompt token it computes: those not read from it were written."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": input_tokens - cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


def response_body(
    rid: str,
    created_at: int,
    model: str,
    body: ResponsesRequest,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    incomplete_details: dict[str, str] | None = None,
    error: dict[str, Any] | None = None,
    sampling_defaults: Mapping[str, int | float] | None = None,
) -> dict[str, Any]:
    """The response object: its state, its output, and the request's settings as OpenAI
    echoes them (the sampling as applied: a knob the request left out shows the model's
    default, `sampling_defaults`)."""
    done = status not in ("in_progress", "queued")
    applied = {**(sampling_defaults or {}), **body.knobs()}
    fields = type(body).model_fields
    return {
        "id": rid,
        "object": "response",
        "created_at": created_at,
        "completed_at": int(time.time()) if status == "completed" else None,
        "status": status,
        "background": body.background,
        "error": error,
        "incomplete_details": incomplete_details,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "model": model,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": body.reasoning.model_dump() if body.reasoning else {"effort": None, "summary": None},
        "store": body.store,
        "temperature": applied.get("temperature", fields["temperature"].default),
        "text": body.text.model_dump(by_alias=True, exclude_none=True) if body.text else {"format": {"type": "text"}},
        "tool_choice": _tool_choice(body),
        "tools": [t.model_dump() for t in body.tools or []],
        "top_logprobs": body.top_logprobs,
        "top_p": applied.get("top_p", fields["top_p"].default),
        "truncation": body.truncation,
        "usage": usage if done else None,
        "user": body.user,
    }


def _tool_choice(body: ResponsesRequest) -> Any:
    if body.tool_choice is None:
        return "auto"
    return body.tool_choice if isinstance(body.tool_choice, str) else body.tool_choice.model_dump()
