"""The stored responses of /v1/responses (`store: true`), in the tokenizer process's memory.

A stored response keeps what its request added to the conversation (its input items) and
what the model answered (its output items), and the id of the response it continued. A
conversation is rebuilt by walking those ids back to its first response, so each turn is
stored once, not once per later turn. The store holds at most `--responses-store-size`
responses and forgets the least recently used first; a conversation that reaches a
forgotten response is a 400, as one naming an id never stored. Nothing survives a restart
of the tokenizer process.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tokenizer_proc.errors import APIError


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]
    """The response object, as GET /v1/responses/{id} returns it."""
    input_items: list[Any]
    """The request's input items (`responses_protocol` models), without its instructions."""
    output_items: list[Any]
    """The output items, parsed back into input item models (as a client would send them)."""
    previous_response_id: str | None


class ResponseStore:
    """Owner of the stored responses; the routes read and write it through `FrontendState`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, rid: str, stored: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self._responses[rid] = stored
        self._responses.move_to_end(rid)
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def get(self, rid: str) -> StoredResponse | None:
        stored = self._responses.get(rid)
        if stored is not None:
            self._responses.move_to_end(rid)
        return stored

    def delete(self, rid: str) -> bool:
        return self._responses.pop(rid, None) is not None

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
            turns.append(stored)
            rid = stored.previous_response_id
        return [item for turn in reversed(turns) for item in (*turn.input_items, *turn.output_items)]
