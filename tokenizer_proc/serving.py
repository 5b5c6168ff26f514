"""Glue between `RequestHandle`s and HTTP responses, shared by every generating endpoint.

- `merge_outputs`: the outputs of the n choices of one HTTP request, in arrival order.
- `collect`: run the choices to the end for a non-streaming response, aborting them if
  the client disconnects first (Starlette does not notice a disconnect on its own there).
- `ChoiceResult`: what a finished choice accumulated.
- `sse` / `SSE_DONE`: server-sent-event framing.

Closing any of these generators closes the handles, which aborts unfinished requests in
the scheduler: that is how a vanished streaming client frees its KV.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import Request

from tokenizer_proc.errors import SERVER_ERROR, SERVER_UNAVAILABLE, APIError
from tokenizer_proc.request_handle import GenerationOutput, RequestHandle
from trident.wire.logprobs import PromptLogprobs

SSE_DONE = b"data: [DONE]\n\n"
_END = object()
_JSON = msgspec.json.Encoder()


def sse(obj: Any) -> bytes:
    """One event. msgspec writes the compact UTF-8 JSON that json.dumps(ensure_ascii=False)
    would, several times faster: a streamed chunk per request per step adds up."""
    return b"data: " + _JSON.encode(obj) + b"\n\n"


def typed_sse(event: dict[str, Any]) -> bytes:
    """One event with its type on an `event:` line, as the Responses API and Anthropic's
    Messages API send theirs (the type is also in the data, under `type`)."""
    return b"event: " + event["type"].encode() + b"\ndata: " + _JSON.encode(event) + b"\n\n"


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


CLIENT_CLOSED = 499
"""Status logged for a request whose client left first (nginx's convention)."""


def merge_outputs(handles: Sequence[RequestHandle]) -> AsyncIterator[GenerationOutput]:
    """Yield outputs of all handles as they arrive; closing this closes (aborts) them all.

    One handle's outputs are its own generator, which closes it however it ends: wrapped,
    each token of a streamed request would resume one more generator."""
    if len(handles) == 1:
        return handles[0].outputs()
    return _merged_outputs(handles)


async def _merged_outputs(handles: Sequence[RequestHandle]) -> AsyncIterator[GenerationOutput]:
    try:
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def pump(handle: RequestHandle) -> None:
            try:
                async for out in handle.outputs():
                    queue.put_nowait(out)
            except Exception as e:  # surfaced to the consumer below
                queue.put_nowait(e)
            finally:
                queue.put_nowait(_END)

        tasks = [asyncio.create_task(pump(h)) for h in handles]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is _END:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
    finally:
        for handle in handles:
            handle.close()


@dataclass
class ChoiceResult:
    """Everything one choice produced, accumulated over its outputs."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""
    embedding: bytes = b""
    prompt_logprobs: PromptLogprobs | None = None
    stop_reason: int | str | None = None
    """vLLM's: the stop string or stop token id that ended the choice (`GenerationOutput`)."""

    def add(self, out: GenerationOutput) -> None:
        self.text += out.text
        self.token_ids.extend(out.token_ids)
        self.token_logprobs.extend(out.token_logprobs)
        self.top_logprobs.extend(out.top_logprobs)
        self.prompt_tokens = out.prompt_tokens
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        self.prompt_logprobs = self.prompt_logprobs or out.prompt_logprobs
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason
            self.error = out.error
            self.embedding = out.embedding


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(request: Request | None, handles: Sequence[RequestHandle]) -> list[ChoiceResult]:
    """Run every choice to its end; raise ClientDisconnected (after aborting) if the client leaves."""
    results = [ChoiceResult(i) for i in range(len(handles))]

    async def run() -> None:
        async for out in merge_outputs(handles):
            results[out.index].add(out)

    runner = asyncio.create_task(run())
    watcher = asyncio.create_task(_wait_disconnect(request)) if request is not None else None
    try:
        waiting = {runner} | ({watcher} if watcher else set())
        done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if runner not in done:
            raise ClientDisconnected()
        runner.result()
    finally:
        for task in (runner, watcher):
            if task is not None and not task.done():
                task.cancel()
        for handle in handles:
            handle.close()
    raise_if_error(results)
    return results


def raise_if_error(results: Sequence[ChoiceResult]) -> None:
    """A choice the scheduler failed (finish_reason "error") fails the whole response with a 500."""
    for r in results:
        if r.finish_reason == "error":
            if r.error.startswith(SERVER_UNAVAILABLE):
                raise APIError(r.error, 503, type_=SERVER_ERROR, headers={"Retry-After": "30"})
            raise APIError(f"generation failed: {r.error or 'unknown error'}", 500, type_=SERVER_ERROR)


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def usage_of(results: Sequence[ChoiceResult], prompt_tokens: int) -> dict[str, Any]:
    """OpenAI counts the prompt once, whatever n is."""
    completion = sum(r.completion_tokens for r in results)
    cached = max((r.cached_tokens for r in results), default=0)
    return usage_dict(prompt_tokens, completion, cached)


def stream_error_event(message: str) -> bytes:
    return sse({"error": {"message": message, "type": SERVER_ERROR, "param": None, "code": None}})
