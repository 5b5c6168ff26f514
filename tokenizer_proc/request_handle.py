"""One open request as the HTTP side sees it: what the tokenizer keeps per rid
(`OpenRequest`), the handle a route iterates (`RequestHandle`), and what each iteration
yields (`GenerationOutput`). `RequestManager` creates them and feeds their queues."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from tokenizer_proc.detokenizer import RequestDetokenizer
from trident.wire.frontend import RowExtras, SamplingParams
from trident.wire.logprobs import PromptLogprobs

if TYPE_CHECKING:
    from tokenizer_proc.request_manager import RequestManager


class TokenOut(msgspec.Struct):
    """One request's share of a step (a row of the scheduler's `TokenOutBatch`), or a finish
    this process decides itself (abort, unhealthy server). Made by the receive task."""

    rid: str
    token_ids: list[int]
    """New tokens since the previous TokenOut of this request."""
    finish_reason: str | None = None
    """stop | length | abort | error; None while the request runs."""
    cached_tokens: int = 0
    error: str = ""
    token_logprobs: list[float] = []
    top_logprobs: list[list[tuple[int, float]]] = []
    embedding: bytes = b""
    """An embedding request's vector (`RowExtras.embedding`), with its finish."""
    prompt_logprobs: PromptLogprobs | None = None
    """With the request's first output, when it asked for prompt logprobs."""

    @classmethod
    def of_row(cls, rid: str, token_ids: list[int], extras: RowExtras | None) -> TokenOut:
        if extras is None:
            return cls(rid, token_ids)
        return cls(
            rid,
            token_ids,
            extras.finish_reason,
            extras.cached_tokens,
            extras.error,
            extras.token_logprobs,
            extras.top_logprobs,
            extras.embedding,
            extras.prompt_logprobs,
        )


def take_queued(out: TokenOut, queue: asyncio.Queue[TokenOut]) -> TokenOut:
    """`out` with the outputs already queued behind it folded in, up to a finish.

    A tokenizer that falls behind the scheduler (thousands of rows a step) finds several
    steps queued per request: detokenizing and yielding them as one costs one task wake-up
    instead of one per step, so the further it falls behind, the faster it catches up,
    and HTTP requests (an /abort, /server_info) still get turns on the event loop."""
    if queue.empty() or out.finish_reason is not None:
        return out
    token_ids, token_logprobs, top_logprobs = list(out.token_ids), list(out.token_logprobs), list(out.top_logprobs)
    cached, error, finish = out.cached_tokens, out.error, None
    embedding, prompt_logprobs = out.embedding, out.prompt_logprobs
    while finish is None and not queue.empty():
        nxt = queue.get_nowait()
        token_ids += nxt.token_ids
        token_logprobs += nxt.token_logprobs
        top_logprobs += nxt.top_logprobs
        cached, error, finish = max(cached, nxt.cached_tokens), nxt.error or error, nxt.finish_reason
        embedding = nxt.embedding or embedding
        prompt_logprobs = prompt_logprobs or nxt.prompt_logprobs
    return TokenOut(out.rid, token_ids, finish, cached, error, token_logprobs, top_logprobs, embedding, prompt_logprobs)


@dataclass
class GenerationOutput:
    """What one request produced since its previous output, ready for the HTTP layer."""

    rid: str
    index: int
    """Choice index within its HTTP request (n > 1)."""
    text: str
    token_ids: list[int]
    token_logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str | None
    """stop | length | abort | error; None while running."""
    prompt_tokens: int
    completion_tokens: int
    """Cumulative."""
    cached_tokens: int
    error: str = ""
    embedding: bytes = b""
    """An embedding request's vector, little-endian float32 (with its finish)."""
    prompt_logprobs: PromptLogprobs | None = None
    """Once, with the first output, when the request asked for prompt logprobs."""
    stop_reason: int | str | None = None
    """With finish "stop": the stop string or stop token id that ended the output (vLLM's
    `stop_reason`); None for the end-of-sequence token."""


@dataclass(frozen=True)
class SchedulingOptions:
    """How the scheduler treats a request beyond its prompt and sampling: the client's fields,
    written by the route (`GenerateReq.cache_salt`, `GenerateReq.priority`)."""

    cache_salt: str = ""
    priority: int = 0


@dataclass
class OpenRequest:
    rid: str
    index: int
    prompt_ids: list[int]
    sampling: SamplingParams
    detok: RequestDetokenizer
    replica: int
    """The data-parallel replica whose scheduler runs it."""
    queue: asyncio.Queue[TokenOut] = field(default_factory=asyncio.Queue)
    generated: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    created: float = field(default_factory=time.monotonic)
    scheduler_done: bool = False
    """The scheduler finished it, or was already told to abort it: no AbortReq is due."""
    embedding: bool = False
    """An /v1/embeddings input (`EmbedReq`): it samples nothing, `sampling` is unused."""
    prompt_logprobs_received: bool = False
    """Its prompt logprobs arrived: a resubmission asks for none again."""
    scheduling: SchedulingOptions = SchedulingOptions()
    """Sent with the request, and again with a resubmission."""


class RequestHandle:
    """One submitted request; iterate `outputs()` once, or `close()` it."""

    def __init__(self, manager: RequestManager, req: OpenRequest) -> None:
        self._manager = manager
        self._req = req
        self._closed = False

    @property
    def rid(self) -> str:
        return self._req.rid

    async def outputs(self) -> AsyncIterator[GenerationOutput]:
        req = self._req
        metrics = self._manager.metrics
        last = req.created
        try:
            while True:
                out = take_queued(await req.queue.get(), req.queue)
                now = time.monotonic()
                if out.token_ids and metrics is not None:
                    if not req.generated:
                        metrics.ttft.observe(now - req.created)
                        metrics.observe_prefill(len(req.prompt_ids), out.cached_tokens)
                    else:
                        metrics.itl.observe(now - last)
                    metrics.count_generated(len(out.token_ids))
                if out.token_ids:
                    last = now
                req.generated.extend(out.token_ids)
                req.cached_tokens = max(req.cached_tokens, out.cached_tokens)
                finish = out.finish_reason
                if finish is not None:
                    req.scheduler_done = True
                step = req.detok.step(out.token_ids, finish)
                if step.stop_string_hit and finish is None:
                    finish = "stop"  # the scheduler still runs it: close() aborts it there
                yield GenerationOutput(
                    rid=req.rid,
                    index=req.index,
                    text=step.text,
                    token_ids=list(out.token_ids),
                    token_logprobs=list(out.token_logprobs),
                    top_logprobs=[list(t) for t in out.top_logprobs],
                    finish_reason=finish,
                    prompt_tokens=len(req.prompt_ids),
                    completion_tokens=len(req.generated),
                    cached_tokens=req.cached_tokens,
                    error=out.error,
                    embedding=out.embedding,
                    prompt_logprobs=out.prompt_logprobs,
                    stop_reason=step.stop_reason,
                )
                if finish is not None:
                    if metrics is not None:
                        metrics.e2e.observe(now - req.created)
                        metrics.finished.labels(finish_reason=finish).inc()
                    return
        finally:
            self.close()

    def close(self) -> None:
        """Unregister; abort in the scheduler unless it already finished. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._manager.release(self._req)
