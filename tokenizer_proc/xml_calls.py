"""The XML tool-call format of Qwen3-Coder (vLLM's `qwen3_coder` parser):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is text, read by the type its schema gives: a string stays as written
(so a zip code "01234" is not a number); numbers, booleans, null, objects and arrays are read
as JSON, and stay text where they do not parse. A call goes out whole once its block ends, as
vLLM's parser sends it: content streams up to where a `<tool_call>` may begin. A block that
names a tool the request did not offer, or has no `<function=...>`, is content. The
constraint of a forced call in this format is tool_grammar.py's, with the other families'.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tokenizer_proc.reasoning import partial_marker_tail
from tokenizer_proc.tool_parsers import Event, StreamingCallParser, ToolCallFormat, openai_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


@dataclass(frozen=True)
class XmlFormat(ToolCallFormat):
    def calls_text(self, calls: list[tuple[str, str]]) -> str:
        """(name, arguments) pairs as JSON text, as Qwen3-Coder writes them; text that is no
        JSON (the system prompt's placeholders) stands for one parameter."""
        written = []
        for name, args in calls:
            try:
                name, kwargs = json.loads(name), json.loads(args)
            except ValueError:
                kwargs = {"<parameter name>": "<value>"}
                name = name.strip('"')
            parameters = "".join(f"<parameter={k}>\n{xml_value_text(v)}\n</parameter>\n" for k, v in kwargs.items())
            written.append(f"{OPEN}\n<function={name}>\n{parameters}</function>\n{CLOSE}")
        return "\n".join(written)


QWEN3_CODER = XmlFormat("qwen3_coder", OPEN, CLOSE, "<", "arguments")


def xml_value_text(value: Any) -> str:
    """A parameter's value as the format writes it: a string as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def typed_value(text: str, schema: Any) -> Any:
    """A parameter's text as its schema's type has it (see the module's docstring)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string":
        return text
    if kind == "boolean" and text.strip() in ("True", "False"):
        return text.strip() == "True"
    try:
        return json.loads(text)
    except ValueError:
        return text


def read_call(block: str, schemas: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of one block, or None when it names no offered tool."""
    function = _FUNCTION.search(block)
    if function is None or function.group(1).strip() not in schemas:
        return None
    name = function.group(1).strip()
    properties = (schemas[name] or {}).get("properties") or {}
    arguments = {}
    for parameter in _PARAMETER.finditer(function.group(2)):
        key, text = parameter.group(1).strip(), parameter.group(2)
        text = text.removeprefix("\n").removesuffix("\n")
        arguments[key] = typed_value(text, properties.get(key))
    return name, arguments


class XmlCallParser(StreamingCallParser):
    """One choice's text in the XML format. Modes: `text` (content; watching for `<tool_call>`)
    and `block` (a call, held until its `</tool_call>`)."""

    def __init__(self, schemas: dict[str, Any]) -> None:
        super().__init__(set(schemas), "text")
        self._schemas = schemas
        """Tool name -> its parameters' JSON schema: how each value's text is read."""

    def _step(self, events: list[Event], final: bool) -> bool:
        buf = self._buffer
        if self._mode == "text":
            start = buf.find(OPEN)
            if start < 0:
                held = partial_marker_tail(buf, OPEN)
                self._content(events, buf[: len(buf) - held])
                self._buffer = buf[len(buf) - held :]
                return False
            self._content(events, buf[:start])
            self._buffer, self._mode = buf[start:], "block"
            return True
        end = buf.find(CLOSE)
        if end < 0:
            return False
        self._emit_block(events, buf[: end + len(CLOSE)])
        self._buffer, self._mode = buf[end + len(CLOSE) :], "text"
        return True

    def _finish(self, events: list[Event], complete: bool) -> None:
        """A block cut before its `</tool_call>` is a call if the output stopped by itself and
        its `</function>` was written; anything else held is content."""
        rest, self._buffer = self._buffer, ""
        if self._mode == "block" and complete and "</function>" in rest:
            self._emit_block(events, rest)
        else:
            self._content(events, rest)

    def _emit_block(self, events: list[Event], block: str) -> None:
        call = read_call(block, self._schemas)
        if call is None:
            self._content(events, block)
            return
        events.append(("call", openai_call(*call)))
        self._after_call = True
