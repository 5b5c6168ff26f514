"""The shapes /v1/responses answers with: output items, the response object, stream events.

One `ResponseOutput` turns a choice's deltas (`ChoiceOutput.feed`: reasoning, content, tool
calls) into output items, and into the events that announce them as they grow: an item is
added, its text grows by deltas, and it is done when the next kind of output begins or the
response ends. A non-streamed response feeds the same object its whole text once and keeps
the items, so both answers agree.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from tokenizer_proc.responses_protocol import ResponsesRequest


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseOutput:
    """A response's output items so far, and its stream's sequence numbers."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        """The item being written (the last of `items`), or None."""
        self._text = ""
        """The open item's text so far: reasoning, output text or call arguments."""
        self._logprobs: list[dict[str, Any]] = []
        """The open message's token logprobs so far."""
        self._pending_logprobs: list[dict[str, Any]] = []
        """Logprobs of tokens whose text was held back, sent with the next text delta."""
        self._sequence = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """A stream event, numbered in the order it is sent."""
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def feed(self, delta: dict[str, Any], logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """The events of one choice delta; `logprobs`: its tokens' (chat's `content` entries)."""
        self._pending_logprobs += logprobs or []
        events: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            events += self._write("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._write("message", delta["content"])
        for call in delta.get("tool_calls", ()):
            if "id" in call:
                events += self._close("completed")
                events += self._open_item(
                    {
                        "id": _new_id("fc"),
                        "type": "function_call",
                        "call_id": call["id"],
                        "name": call["function"]["name"],
                        "arguments": "",
                        "status": "in_progress",
                    }
                )
            if call["function"].get("arguments"):
                events += self._write("function_call", call["function"]["arguments"])
        return events

    def finish(self, status: str) -> list[dict[str, Any]]:
        """The events that close the open item, `status` that of the response's items. Only
        output text has logprobs: those of a call's tokens are not shown."""
        return self._close(status)

    def _write(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed")
            events += self._open_item(_message() if kind == "message" else _reasoning())
        self._text += text
        where = self._where()
        if kind == "reasoning":
            events.append(self.event("response.reasoning_text.delta", **where, content_index=0, delta=text))
        elif kind == "message":
            logprobs, self._pending_logprobs = self._pending_logprobs, []
            self._logprobs += logprobs
            events.append(
                self.event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=logprobs)
            )
        else:
            events.append(self.event("response.function_call_arguments.delta", **where, delta=text))
        return events

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1}

    def _open_item(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self._open, self._text, self._logprobs = item, "", []
        events = [self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))]
        part = self._part()
        if part is not None:
            events.append(self.event("response.content_part.added", **self._where(), content_index=0, part=part))
        return events

    def _part(self) -> dict[str, Any] | None:
        """The open item's content part as written so far (a call has none)."""
        assert self._open is not None
        if self._open["type"] == "message":
            return {"type": "output_text", "text": self._text, "annotations": [], "logprobs": self._logprobs}
        if self._open["type"] == "reasoning":
            return {"type": "reasoning_text", "text": self._text}
        return None

    def _close(self, status: str) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        if self._pending_logprobs and item["type"] == "message":
            self._logprobs += self._pending_logprobs
            self._pending_logprobs = []
        where = self._where()
        part = self._part()
        events: list[dict[str, Any]] = []
        if item["type"] == "message":
            events.append(
                self.event(
                    "response.output_text.done", **where, content_index=0, text=self._text, logprobs=self._logprobs
                )
            )
        elif item["type"] == "reasoning":
            events.append(self.event("response.reasoning_text.done", **where, content_index=0, text=self._text))
        else:
            item["arguments"] = self._text
            events.append(self.event("response.function_call_arguments.done", **where, arguments=self._text))
        if part is not None:
            item["content"] = [part]
            events.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        item["status"] = status
        events.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        self._open = None
        return events


def _message() -> dict[str, Any]:
    return {"id": _new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}


def _reasoning() -> dict[str, Any]:
    return {"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}


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
) -> dict[str, Any]:
    """The response object: its state, its output, and the request's settings as OpenAI echoes them."""
    done = status not in ("in_progress", "queued")
    return {
        "id": rid,
        "object": "response",
        "created_at": created_at,
        "completed_at": int(time.time()) if status == "completed" else None,
        "status": status,
        "background": False,
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
        "temperature": body.temperature,
        "text": body.text.model_dump(by_alias=True, exclude_none=True) if body.text else {"format": {"type": "text"}},
        "tool_choice": _tool_choice(body),
        "tools": [t.model_dump() for t in body.tools or []],
        "top_logprobs": body.top_logprobs,
        "top_p": body.top_p,
        "truncation": body.truncation,
        "usage": usage if done else None,
        "user": body.user,
    }


def _tool_choice(body: ResponsesRequest) -> Any:
    if body.tool_choice is None:
        return "auto"
    return body.tool_choice if isinstance(body.tool_choice, str) else body.tool_choice.model_dump()
