"""A choice's output as a sequence of blocks, each of one kind: reasoning, text, or a call.

The Responses API (output items) and Anthropic's Messages API (content blocks) both answer
in such blocks, and both stream them the same way: a block opens when its kind of output
begins, grows by deltas, and closes when the next kind begins or the output ends. This base
walks a choice's deltas (`ChoiceOutput.feed`: reasoning, content, tool calls) into those
steps; each API's subclass says what events each step sends.
"""

from __future__ import annotations

from typing import Any

REASONING = "reasoning"
TEXT = "text"
CALL = "call"


class OutputBlocks:
    """The block being written and its text so far; subclasses turn the steps into events."""

    def __init__(self) -> None:
        self.open_kind: str | None = None
        """The kind of the block being written, or None between blocks."""
        self.text = ""
        """The open block's text so far: reasoning, answer text or call arguments."""

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one choice delta."""
        events: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            events += self._write(REASONING, delta["reasoning_content"])
        if delta.get("content"):
            events += self._write(TEXT, delta["content"])
        for call in delta.get("tool_calls", ()):
            if "id" in call:  # a new call: its id and name, then its arguments
                events += self.close()
                events += self._open(CALL, call)
            if call["function"].get("arguments"):
                events += self._write(CALL, call["function"]["arguments"])
        return events

    def close(self) -> list[dict[str, Any]]:
        """The events that close the open block, if any."""
        if self.open_kind is None:
            return []
        events = self.closed(self.open_kind, self.text)
        self.open_kind = None
        return events

    def _open(self, kind: str, call: dict[str, Any] | None) -> list[dict[str, Any]]:
        events = self.opened(kind, call)
        self.open_kind, self.text = kind, ""
        return events

    def _write(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.open_kind != kind:
            events += self.close()
            events += self._open(kind, None)
        self.text += text
        return events + self.written(kind, text)

    def opened(self, kind: str, call: dict[str, Any] | None) -> list[dict[str, Any]]:
        """A block of `kind` begins; a call's opening delta (its id and name) comes with it."""
        raise NotImplementedError

    def written(self, kind: str, text: str) -> list[dict[str, Any]]:
        """The open block grew by `text` (`self.text` holds it all)."""
        raise NotImplementedError

    def closed(self, kind: str, text: str) -> list[dict[str, Any]]:
        """The open block is whole: `text` is all of it."""
        raise NotImplementedError
