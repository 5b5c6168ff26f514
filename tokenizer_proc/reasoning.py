"""Reasoning models' thinking, split from the answer: `<think>...</think>` goes to
`reasoning_content`, the rest to `content`.

`--reasoning-parser qwen3|deepseek_r1` both read `<think>...</think>`; `auto` picks them when
the chat template writes `<think>`. Whether the thinking is already open when the output
starts is read from the rendered prompt, not from the family: DeepSeek-R1's template (and
Qwen3's thinking-only ones) end the prompt with `<think>`, Qwen3's with `enable_thinking:
false` closes an empty one, and otherwise the model opens its own.
"""

from __future__ import annotations

from typing import Any

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def uses_reasoning_parser(flag: str, tokenizer: Any) -> bool:
    if flag == "auto":
        template = getattr(tokenizer, "chat_template", None) or ""
        return THINK_OPEN in str(template)
    return flag != "none"


def thinking_open_in(prompt_text: str) -> bool:
    """The prompt ends inside a `<think>` block: the output starts with reasoning."""
    return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)


def thinking_skipped_in(prompt_text: str) -> bool:
    """The prompt ends with a closed, empty `<think>` block (Qwen3's `enable_thinking: false`):
    the output is all answer, so a constraint applies from its first token."""
    return prompt_text.rstrip().endswith(THINK_CLOSE)


def partial_marker_tail(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`: held back, as the next
    piece may complete the marker."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """One choice's text split into ("reasoning", text) and ("content", text) as it arrives.

    Modes: `start` (only whitespace so far; `<think>` may open), `reasoning` (until
    `</think>`), `content`. The whitespace between `</think>` and the answer is dropped.
    """

    def __init__(self, open_at_start: bool) -> None:
        self._mode = "reasoning" if open_at_start else "start"
        self._buffer = ""
        self._trim = False
        """Just past `</think>`: leading whitespace of the answer is dropped."""

    def feed(self, piece: str) -> list[tuple[str, str]]:
        self._buffer += piece
        events: list[tuple[str, str]] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[tuple[str, str]]:
        rest, self._buffer = self._buffer, ""
        kind = "reasoning" if self._mode == "reasoning" else "content"
        if self._trim:
            rest = rest.lstrip()
        return [(kind, rest)] if rest else []

    def _step(self, events: list[tuple[str, str]]) -> bool:
        buf = self._buffer
        if self._mode == "start":
            stripped = buf.lstrip()
            if stripped.startswith(THINK_OPEN):
                self._buffer, self._mode = stripped[len(THINK_OPEN) :], "reasoning"
                return True
            if not stripped or THINK_OPEN.startswith(stripped):
                return False
            self._mode = "content"
            return True
        if self._mode == "reasoning":
            at = buf.find(THINK_CLOSE)
            if at >= 0:
                if buf[:at]:
                    events.append(("reasoning", buf[:at]))
                self._buffer, self._mode, self._trim = buf[at + len(THINK_CLOSE) :], "content", True
                return True
            keep = partial_marker_tail(buf, THINK_CLOSE)
            if len(buf) > keep:
                events.append(("reasoning", buf[: len(buf) - keep]))
                self._buffer = buf[len(buf) - keep :]
            return False
        if self._trim:
            buf = buf.lstrip()
            if not buf:
                self._buffer = ""
                return False
            self._trim = False
        if buf:
            events.append(("content", buf))
        self._buffer = ""
        return False
