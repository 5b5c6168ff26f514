"""The pythonic tool-call format (Llama 4, Llama 3.2's and some fine-tunes' prompts): the
output is one Python list of calls with keyword arguments,
`[get_weather(city="Paris"), get_time()]`, perhaps inside `<|python_start|>...<|python_end|>`.

Argument values are Python literals only (strings, numbers, True/False/None, lists, dicts,
tuples), read with `ast.literal_eval`, never evaluated; they go out as JSON. Streaming as
vLLM's pythonic parser does: a call goes out (name, empty arguments) once `name(` is written,
then its arguments JSON grows one keyword argument at a time, each as soon as its value ends.
An output that does not open with such a list is content; a call that turns out malformed
after its name went out keeps the arguments read so far, and the rest is content.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any

from tokenizer_proc.tool_parsers import Event, StreamingCallParser, ToolCallFormat

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_NAME = r"[A-Za-z_][\w.-]{0,63}"
_LIST_HEAD = re.compile(rf"\[\s*({_NAME})\s*\(")
_LIST_HEAD_SO_FAR = re.compile(rf"\[\s*(?:{_NAME}\s*)?")
_NEXT_HEAD = re.compile(rf",\s*({_NAME})\s*\(")
_NEXT_HEAD_SO_FAR = re.compile(rf",\s*(?:{_NAME}\s*)?")
_KEYWORD = re.compile(r"([A-Za-z_]\w*)\s*=\s*")
_KEYWORD_SO_FAR = re.compile(r"[A-Za-z_]\w*\s*")


def python_literal(value: Any) -> str:
    """A JSON value written as the Python literal the model would write."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(python_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {python_literal(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


@dataclass(frozen=True)
class PythonicFormat(ToolCallFormat):
    def calls_text(self, calls: list[tuple[str, str]]) -> str:
        """(name, arguments) pairs as JSON text; text that is no JSON (the system prompt's
        placeholders) is written as it is."""
        written = []
        for name, args in calls:
            try:
                name, kwargs = json.loads(name), json.loads(args)
                written.append(f"{name}({', '.join(f'{k}={python_literal(v)}' for k, v in kwargs.items())})")
            except ValueError:
                written.append(f"{name.strip(chr(34))}(<argument>=<value>, ...)")
        return f"[{', '.join(written)}]" if written else ""


PYTHONIC = PythonicFormat("pythonic", PYTHON_START, PYTHON_END, "[", "arguments")


def value_end(text: str, start: int) -> int | None:
    """The index of the `,` or `)` that ends the Python value starting at `start`, or None
    while it is incomplete; brackets and quotes inside strings do not count."""
    depth, quote, i = 0, "", start
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif text.startswith(quote, i):
                i += len(quote) - 1
                quote = ""
        elif ch in "'\"":
            quote = ch * 3 if text.startswith(ch * 3, i) else ch
            i += len(quote) - 1
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                return i if ch == ")" else None
            depth -= 1
        elif ch == "," and depth == 0:
            return i
        i += 1
    return None


class PythonicCallParser(StreamingCallParser):
    """One choice's text as content and pythonic calls, with ToolCallParser's events.

    Modes: `start` (whitespace, perhaps `<|python_start|>`, until the list's first call head
    decides), `arguments` (a call's keyword arguments), `between` (after a call: `, next(`
    or the list's `]`), `text` (content)."""

    def __init__(self, names: set[str]) -> None:
        super().__init__(names, "start")
        self._opened = False
        """The streaming call's arguments object has its `{`."""

    def _finish(self, events: list[Event], complete: bool) -> None:
        if complete and self._mode == "arguments":  # only its closing brackets were missing
            self._buffer += ")"
        self._run(events, final=True)
        if self._mode in ("arguments", "between"):  # cut off inside the list: the calls stand
            self._buffer = ""
        self._content(events, self._buffer)
        self._buffer = ""

    def _step(self, events: list[Event], final: bool) -> bool:
        if self._mode == "start":
            return self._start_step(events, final)
        if self._mode == "arguments":
            return self._arguments_step(events)
        if self._mode == "between":
            return self._between_step(events)
        if self._after_call:  # the list's closing `<|python_end|>` is no content
            text = self._buffer.lstrip()
            if text.startswith(PYTHON_END):
                self._buffer = text[len(PYTHON_END) :]
            elif PYTHON_END.startswith(text) and not final:
                return False
        self._content(events, self._buffer)
        self._buffer = ""
        return False

    def _start_step(self, events: list[Event], final: bool) -> bool:
        text = self._buffer.lstrip()
        text = text.removeprefix(PYTHON_START).lstrip()
        head = _LIST_HEAD.match(text)
        if head is not None and head.group(1) in self._names:
            self._start_call(events, head.group(1), text[head.end() :])
            return True
        undecided = not text or PYTHON_START.startswith(text) or _LIST_HEAD_SO_FAR.fullmatch(text)
        if undecided and not final:
            return False
        self._mode = "text"
        return bool(self._buffer)

    def _start_call(self, events: list[Event], name: str, rest: str) -> None:
        self._open_call(events, name)
        self._buffer, self._mode, self._opened = rest, "arguments", False

    def _arguments_step(self, events: list[Event]) -> bool:
        text = self._buffer.lstrip()
        if text.startswith(")"):
            events.append(("arguments", "}" if self._opened else "{}"))
            self._buffer, self._mode = text[1:], "between"
            return True
        keyword = _KEYWORD.match(text)
        if keyword is None:
            if not text or _KEYWORD_SO_FAR.fullmatch(text):
                self._buffer = text
                return False
            return self._malformed(events, text)
        end = value_end(text, keyword.end())
        if end is None:
            self._buffer = text
            return False
        try:
            value = json.dumps(ast.literal_eval(text[keyword.end() : end].strip()))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return self._malformed(events, text)
        events.append(("arguments", ("{" if not self._opened else ", ") + f"{json.dumps(keyword.group(1))}: {value}"))
        self._opened = True
        self._buffer = text[end + 1 :] if text[end] == "," else text[end:]
        return True

    def _between_step(self, events: list[Event]) -> bool:
        text = self._buffer.lstrip()
        if text.startswith("]"):
            self._buffer, self._mode = text[1:], "text"
            return True
        head = _NEXT_HEAD.match(text)
        if head is not None and head.group(1) in self._names:
            self._start_call(events, head.group(1), text[head.end() :])
            return True
        if not text or _NEXT_HEAD_SO_FAR.fullmatch(text):
            self._buffer = text
            return False
        self._buffer, self._mode = text, "text"
        return True

    def _malformed(self, events: list[Event], text: str) -> bool:
        """The call's arguments are not keyword literals: it keeps what was read, closed."""
        events.append(("arguments", "}" if self._opened else "{}"))
        self._buffer, self._mode = text, "text"
        return True
