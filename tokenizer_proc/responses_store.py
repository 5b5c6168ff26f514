"""The stored responses of /v1/responses (`store: true`), in the tokenizer process's memory.

A stored response keeps what its request added to the conversation (its input items) and
what the model answered (its output items), and the id of the response it continued. A
conversation is rebuilt by walking those ids back to its first response, so each turn is
stored once, not once per later turn. The store holds at most `--responses-store-size`
responses and STORE_BYTES of them (as JSON), and forgets the least recently used first; a
conversation that reaches a forgotten response is a 400, as one naming an id never stored.
Nothing survives a restart of the tokenizer process. `BackgroundResponses` holds the tasks
that make background responses, which store themselves as they go.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import msgspec

from tokenizer_proc.errors import APIError

logger = logging.getLogger(__name__)

UNFINISHED = ("queued", "in_progress")
"""Statuses of a background response still being made: nothing can continue from it yet."""

STORE_BYTES = 256 * 1024 * 1024
"""What the stored responses may hold in all, measured as their JSON: request bodies run to
--max-request-body-bytes each, so a count alone would not bound the memory."""


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]
    """The response object, as GET /v1/responses/{id} returns it."""
    input_items: list[Any]
    """The request's input items (`responses_protocol` models), without its instructions."""
    output_items: list[Any]
    """The output items, parsed back into input item models (as a client would send them)."""
    previous_response_id: str | None
    listed_input: list[dict[str, Any]]
    """The input items as GET /v1/responses/{id}/input_items lists them (ids given once)."""

    def size(self) -> int:
        """Bytes of its JSON: the measure of what it holds."""
        items = [item.model_dump() for item in (*self.input_items, *self.output_items)]
        return len(_JSON.encode(self.body)) + len(_JSON.encode(items)) + len(_JSON.encode(self.listed_input))


_JSON = msgspec.json.Encoder()


class ResponseStore:
    """Owner of the stored responses; the routes read and write it through `FrontendState`."""

    def __init__(self, capacity: int, max_bytes: int = STORE_BYTES) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self.bytes = 0
        """The JSON size of what is stored."""

    def put(self, rid: str, stored: StoredResponse) -> None:
        self.delete(rid)
        size = stored.size()
        if self.capacity <= 0 or size > self.max_bytes:
            return
        self._responses[rid], self._sizes[rid] = stored, size
        self.bytes += size
        while len(self._responses) > self.capacity or self.bytes > self.max_bytes:
            self.delete(next(iter(self._responses)))

    def get(self, rid: str) -> StoredResponse | None:
        stored = self._responses.get(rid)
        if stored is not None:
            self._responses.move_to_end(rid)
        return stored

    def delete(self, rid: str) -> bool:
        if self._responses.pop(rid, None) is None:
            return False
        self.bytes -= self._sizes.pop(rid)
        return True

    def conversation(self, previous_response_id: str) -> list[Any]:
        """The items of every turn up to and including `previous_response_id`'s, oldest first."""
        turns: list[StoredResponse] = []
        rid: str | None = previous_response_id
        seen: set[str] = set()  # a client's request_id can name a new response as an old one
        while rid is not None and rid not in seen:
            seen.add(rid)
            stored = self.get(rid)
            if stored is None:
                earlier = "" if rid == previous_response_id else f" (an earlier turn of {previous_response_id!r})"
                raise APIError(
                    f"Previous response with id {rid!r}{earlier} not found: it was never stored (`store: false`), "
                    f"was deleted, or was forgotten by this server (it keeps the last --responses-store-size).",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            if stored.body.get("status") in UNFINISHED:
                raise APIError(
                    f"Previous response {rid!r} is still being made in the background: wait until it ends.",
                    param="previous_response_id",
                )
            turns.append(stored)
            rid = stored.previous_response_id
        return [item for turn in reversed(turns) for item in (*turn.input_items, *turn.output_items)]


class BackgroundResponses:
    """The tasks making background responses (`background: true`), by response id. Owner:
    `FrontendState`; each task leaves the table when it ends, having stored the response."""

    def __init__(self, abort: Callable[[str], object]) -> None:
        self._abort = abort
        """`RequestManager.abort`: ends a response's requests with "abort" (status cancelled)."""
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, rid: str, making: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(making)
        self._tasks[rid] = task
        task.add_done_callback(lambda done: self._ended(rid, done))

    def cancel(self, rid: str) -> bool:
        """Abort a response still being made; False when none is."""
        if rid not in self._tasks:
            return False
        self._abort(rid)
        return True

    async def ended(self, rid: str, timeout_s: float) -> None:
        """Wait until the response's task has stored how it ended, or `timeout_s` has passed."""
        task = self._tasks.get(rid)
        if task is not None:
            await asyncio.wait({task}, timeout=timeout_s)

    def _ended(self, rid: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(rid) is task:
            del self._tasks[rid]
        if not task.cancelled() and task.exception() is not None:
            logger.error("background response %s failed: %r", rid, task.exception())
