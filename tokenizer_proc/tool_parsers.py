"""Tool calls in a model's output, per family's format, parsed as the text streams in.

The JSON formats (`--tool-call-parser`; pythonic_calls.py reads the pythonic one, and
tool_formats.py chooses):
- hermes (Hermes, Qwen): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
  block per call; an output that opens with a bare call object is a call too.
- llama3_json (Llama 3.x): `{"name": ..., "parameters": {...}}` (or `arguments`) at the start
  of the output, perhaps after `<|python_tag|>`; parallel calls separated by `;`.
- mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`; a bare array at the start
  is read the same way, as `[TOOL_CALLS]` is a control token that skip_special_tokens removes;
  the newer `[TOOL_CALLS]name[ARGS]{...}` too.

`StreamingCallParser` is what every format's parser shares (the held text, its steps, the
events and the whitespace after a call); each format says only how it differs.
`ToolCallParser` reads one choice's text piece by piece and hands out content and calls as
soon as each is certain, as vLLM streams them: a call written `{"name": ..., "arguments": {`
goes out (name, empty arguments) once that much is written, then its arguments text as it
comes; other calls (arrays, arguments before the name) go out whole when their JSON value
ends; content goes out up to the point where a call might begin. The whole-output parse is
the same parser fed once, so streamed and non-streamed answers agree. A call that names a
tool the request did not offer, or whose JSON does not parse before its name and arguments
went out, is answered as text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tokenizer_proc.reasoning import partial_marker_tail

_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
"""The start of a call object up to its arguments object: from here the arguments stream."""
_NAMED_CALL_HEAD = re.compile(r"([A-Za-z0-9_.-]{1,64})(?:\[ARGS\])?\s*(?=\{)")
_NAMED_CALL_START = re.compile(r"[A-Za-z0-9_.-]{1,64}(?:\[(?:A(?:R(?:G(?:S(?:\])?)?)?)?)?)?\s*")

Call = dict[str, Any]
"""An OpenAI `tool_calls` entry: {"id", "type": "function", "function": {"name", "arguments"}}."""


@dataclass(frozen=True)
class ToolCallFormat:
    """How one family writes calls; `None` markers are absent from the format."""

    name: str
    opener: str | None
    """The marker that introduces calls."""
    closer: str | None
    """The marker that ends one call (hermes); without it a call ends with its JSON value."""
    bare_start: str
    """The character that, opening the output, starts calls written without the opener."""
    arguments_key: str
    """The key this family writes the arguments under (`parameters` is read as well)."""
    named_calls: bool = False
    """After the opener, a call may be written `name[ARGS]{arguments}` (Mistral's newer form)."""

    def calls_text(self, calls: list[tuple[str, str]]) -> str:
        """(name, arguments) pairs, both as JSON text, written as this family writes calls:
        for the system prompt's example and for earlier assistant turns."""
        objects = [f'{{"name": {name}, "{self.arguments_key}": {args}}}' for name, args in calls]
        if not objects:
            return ""
        if self.closer is not None:
            return "".join(f"{self.opener}{obj}{self.closer}" for obj in objects)
        if self.bare_start == "[":
            return f"{self.opener}[{', '.join(objects)}]"
        return "; ".join(objects)


HERMES = ToolCallFormat("hermes", "<tool_call>", "</tool_call>", "{", "arguments")
LLAMA3_JSON = ToolCallFormat("llama3_json", "<|python_tag|>", None, "{", "parameters")
MISTRAL = ToolCallFormat("mistral", "[TOOL_CALLS]", None, "[", "arguments", named_calls=True)
FORCED = ToolCallFormat("forced", None, None, "{", "arguments")
"""A call forced by tool_choice without a parser (`--tool-call-parser none`): the grammar
makes the output exactly one call object."""


def json_value_end(text: str) -> int | None:
    """The end of the JSON object or array that `text` opens with, or None while it is
    incomplete; brackets inside strings do not count."""
    depth = 0
    in_string = escaped = False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def calls_in(value_text: str, names: set[str]) -> list[Call] | None:
    """The calls one JSON value holds (an object, or an array of them), or None unless every
    element is a call to one of `names` with an object of arguments."""
    try:
        value = json.loads(value_text)
    except ValueError:
        return None
    objects = value if isinstance(value, list) else [value]
    calls = []
    for obj in objects:
        if not isinstance(obj, dict) or obj.get("name") not in names:
            return None
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(arguments, str):  # some fine-tunes write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append(openai_call(obj["name"], arguments))
    return calls or None


def openai_call(name: str, arguments: dict[str, Any]) -> Call:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


Event = tuple[str, Any]
"""("content", text), ("call", Call) or ("arguments", more arguments text of the last call)."""


class StreamingCallParser:
    """What every format's parser shares: the text not yet certain is held in `_buffer` and
    read in steps, each consuming what is certain, False when the rest must wait for more
    text; events go out in output order. A format says how a step reads its modes (`_step`)
    and what the end of the output does with the held rest (`_finish`)."""

    def __init__(self, names: set[str], mode: str) -> None:
        self._names = names
        """The tools the request offers: a call to any other name is text."""
        self._buffer = ""
        self._mode = mode
        self._after_call = False
        """A call went out last: whitespace before the content that follows is dropped."""

    def feed(self, piece: str) -> list[Event]:
        """The events that `piece` makes certain, in output order."""
        self._buffer += piece
        events: list[Event] = []
        self._run(events, final=False)
        return events

    def finish(self, complete: bool) -> list[Event]:
        """The held rest once the output ends; `complete`: it stopped by itself (not cut off
        by a length limit), so a call missing only its closing part still counts."""
        events: list[Event] = []
        self._finish(events, complete)
        return events

    def _run(self, events: list[Event], final: bool) -> None:
        while self._step(events, final):
            pass

    def _step(self, events: list[Event], final: bool) -> bool:
        raise NotImplementedError

    def _finish(self, events: list[Event], complete: bool) -> None:
        raise NotImplementedError

    def _open_call(self, events: list[Event], name: str) -> None:
        """A streamed call's first event: its name, its arguments to follow as they come."""
        call = openai_call(name, {})
        call["function"]["arguments"] = ""
        events.append(("call", call))
        self._after_call = True

    def _content(self, events: list[Event], text: str) -> None:
        if self._after_call:
            text = text.lstrip()
        if text:
            events.append(("content", text))
            self._after_call = False


class ToolCallParser(StreamingCallParser):
    """One choice's text in a JSON format, split into content and calls as it arrives.

    Modes: `text` (content; watching for the opener), `values` (JSON values after the opener
    or a bare start), `block` (inside opener...closer), `arguments` (a call's arguments,
    streaming out) and `closing` (what ends that call: `}`, the closer). Whitespace at the very start and
    right after a call is held: it is dropped before a call and kept before content, so an
    answer without calls comes back exactly as written.
    """

    def __init__(self, fmt: ToolCallFormat, names: set[str]) -> None:
        super().__init__(names, "text")
        self._fmt = fmt
        self._at_start = True
        """Nothing but whitespace seen yet: a bare call may still open the output."""
        self._calls = 0
        self._arguments = ""
        """The streaming call's arguments so far (mode `arguments`); `_sent` of them went out."""
        self._sent = 0
        self._expect: list[str] = []
        """What closes the streaming call after its arguments (`}`, hermes' closer)."""
        self._then = "values"
        """The mode after the streaming call closes."""

    def _finish(self, events: list[Event], complete: bool) -> None:
        if self._mode == "closing":  # the output ended inside what closes a call
            self._closing_step(final=True)
        self._run(events, final=complete)
        rest = self._buffer
        if self._mode == "block" and self._fmt.opener:  # cut off inside a call block
            rest = self._fmt.opener + rest
        self._buffer = ""
        if rest.strip() or not self._after_call:  # whitespace after a call is dropped
            self._content(events, rest)

    # ---- one step: consume what is certain, False when the rest must wait -------------

    def _step(self, events: list[Event], final: bool) -> bool:
        if self._mode == "text":
            return self._text_step(events)
        if self._mode == "block":
            return self._block_step(events, final)
        if self._mode == "arguments":
            return self._arguments_step(events)
        if self._mode == "closing":
            return self._closing_step(final)
        return self._values_step(events)

    def _text_step(self, events: list[Event]) -> bool:
        fmt, buf = self._fmt, self._buffer
        stripped = buf.lstrip()
        if (self._at_start or self._after_call) and not stripped:
            return False  # only whitespace so far: hold it
        maybe_opener = fmt.opener is not None and (stripped.startswith(fmt.opener) or fmt.opener.startswith(stripped))
        if self._at_start and stripped.startswith(fmt.bare_start) and not maybe_opener:
            self._buffer, self._mode = stripped, "values"
            return True
        at = buf.find(fmt.opener) if fmt.opener else -1
        if at >= 0:
            before = buf[:at]
            if before.strip() or not (self._at_start or self._after_call):
                self._content(events, before)
            self._buffer = buf[at + len(fmt.opener) :]
            self._mode = "block" if fmt.closer else "values"
            self._after_call = False  # what follows the opener is a call, even `[`
            return True
        keep = partial_marker_tail(buf, fmt.opener) if fmt.opener else 0
        sure = buf[: len(buf) - keep]
        if sure.strip() or (sure and not (self._at_start or self._after_call)):
            self._content(events, sure)
            self._buffer = buf[len(buf) - keep :]
        return False

    def _block_step(self, events: list[Event], final: bool) -> bool:
        assert self._fmt.closer is not None and self._fmt.opener is not None
        if self._stream_call(events, self._buffer.lstrip(), ["}", self._fmt.closer], "text"):
            return True
        at = self._buffer.find(self._fmt.closer)
        if at < 0 and not final:
            return False
        inner = self._buffer[:at] if at >= 0 else self._buffer
        rest = self._buffer[at + len(self._fmt.closer) :] if at >= 0 else ""
        calls = calls_in(inner.strip(), self._names)
        if calls is None:  # not a call after all: the block is text
            self._content(events, self._fmt.opener + inner + (self._fmt.closer if at >= 0 else ""))
        else:
            self._emit_calls(events, calls)
        self._buffer, self._mode = rest, "text"
        return bool(rest)

    def _values_step(self, events: list[Event]) -> bool:
        buf = self._buffer.lstrip()
        if self._calls and buf[:1] in (";", ","):
            buf = buf[1:].lstrip()
        if not buf:
            self._buffer = buf
            return False
        opener = self._fmt.opener
        if opener and self._after_call and (buf.startswith(opener) or opener.startswith(buf)):  # the next opener
            self._buffer, self._mode = buf, "text"
            return True
        if buf[0] not in "{[":
            if self._fmt.named_calls:
                return self._named_call_step(events, buf)
            self._buffer, self._mode = buf, "text"  # the calls are over: the rest is text
            return True
        hermes_bare = self._fmt.closer is not None  # one object, then text
        if self._stream_call(events, buf, ["}"], "text" if hermes_bare else "values"):
            return True
        end = json_value_end(buf)
        if end is None:
            self._buffer = buf
            return False
        calls = calls_in(buf[:end], self._names)
        if calls is None:  # JSON that is no call: it and what follows are text
            self._content(events, buf[:end])
            self._buffer, self._mode = buf[end:], "text"
            return True
        self._emit_calls(events, calls)
        self._buffer = buf[end:]
        if hermes_bare:
            self._mode = "text"
        return True

    def _named_call_step(self, events: list[Event], buf: str) -> bool:
        """Mistral's newer `name[ARGS]{...}` (`[ARGS]` may be stripped as a control token)."""
        head = _NAMED_CALL_HEAD.match(buf)
        if head is None:
            self._buffer = buf
            if _NAMED_CALL_START.fullmatch(buf):  # the name or its marker is still coming
                return False
            self._mode = "text"
            return True
        if head.group(1) not in self._names:
            self._buffer, self._mode = buf, "text"
            return True
        self._start_call(events, head.group(1), buf[head.end() :], [], "values")
        return True

    def _stream_call(self, events: list[Event], buf: str, expect: list[str], then: str) -> bool:
        """Starts streaming the call `buf` opens, once its name and the start of its arguments
        are written; False when it does not (yet) look like one."""
        head = _CALL_HEAD.match(buf)
        if head is None or head.group(1) not in self._names:
            return False
        self._start_call(events, head.group(1), buf[head.end() :], expect, then)
        return True

    def _start_call(self, events: list[Event], name: str, rest: str, expect: list[str], then: str) -> None:
        self._open_call(events, name)
        self._calls += 1
        self._at_start = self._after_call = False  # its whitespace is held from its closing on
        self._buffer, self._mode, self._arguments, self._sent = rest, "arguments", "", 0
        self._expect, self._then = expect, then

    def _arguments_step(self, events: list[Event]) -> bool:
        self._arguments += self._buffer
        self._buffer = ""
        end = json_value_end(self._arguments)
        upto = len(self._arguments) if end is None else end
        if upto > self._sent:
            events.append(("arguments", self._arguments[self._sent : upto]))
            self._sent = upto
        if end is None:
            return False
        self._buffer, self._arguments, self._mode = self._arguments[end:], "", "closing"
        return True

    def _closing_step(self, final: bool) -> bool:
        """Past the arguments: what closes the call (`}`, `</tool_call>`) is consumed; anything
        else ends the call where it is and is read in the next mode."""
        buf = self._buffer.lstrip()
        while self._expect:
            token = self._expect[0]
            if buf.startswith(token):
                buf = buf[len(token) :].lstrip()
                self._expect.pop(0)
            elif token.startswith(buf) and not final:  # may still be coming
                self._buffer = buf
                return False
            else:
                break
        if final and any(token.startswith(buf) for token in self._expect[:1]):
            buf = ""  # the output ended inside the closer
        self._buffer, self._expect, self._mode = buf, [], self._then
        self._after_call = True
        return True

    def _emit_calls(self, events: list[Event], calls: list[Call]) -> None:
        for call in calls:
            events.append(("call", call))
        self._calls += len(calls)
        self._at_start, self._after_call = False, True

    def _content(self, events: list[Event], text: str) -> None:
        super()._content(events, text)
        self._at_start = self._after_call = False  # even all whitespace: it was text
