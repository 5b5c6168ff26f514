"""Which tool-call format the served model writes, and the parser that reads it.

`--tool-call-parser auto` reads the model's chat template, then its control tokens, for the
marks each family's template leaves: Mistral's `[TOOL_CALLS]`, Qwen3-Coder's `<function=`,
Hermes/Qwen's `<tool_call>`,
the pythonic list's `[func_name1(params_name1=...)]` example or Llama 4's `<|python_start|>`,
Llama 3's `<|python_tag|>`, `ipython` role or `"parameters"` key. A template with none of
them gets hermes, the format the system prompt then teaches (tools.py).
"""

from __future__ import annotations

from typing import Any

from tokenizer_proc.pythonic_calls import PYTHON_START, PYTHONIC, PythonicCallParser
from tokenizer_proc.tool_parsers import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    StreamingCallParser,
    ToolCallFormat,
    ToolCallParser,
)
from tokenizer_proc.xml_calls import QWEN3_CODER, XmlCallParser

FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, PYTHONIC, QWEN3_CODER)}

_MARKS: tuple[tuple[ToolCallFormat, tuple[str, ...]], ...] = (
    (MISTRAL, ("[TOOL_CALLS]",)),
    (QWEN3_CODER, ("<function=", "<parameter=")),  # before hermes: its blocks are <tool_call> too
    (HERMES, ("<tool_call>",)),
    (PYTHONIC, ("[func_name1(", "func_name1(params_name1=", PYTHON_START)),
    (LLAMA3_JSON, ("<|python_tag|>", "ipython", '"parameters"')),
)


def choose_tool_format(flag: str, tokenizer: Any) -> ToolCallFormat | None:
    """The format `--tool-call-parser` names, or (`auto`) the one the model's chat template
    and control tokens show; None: calls the model writes stay text."""
    if flag == "none":
        return None
    if flag != "auto":
        return FORMATS[flag]
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):  # several named templates: read them all
        template = " ".join(str(t) for t in dict(template).values())
    vocab = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    for source in (template, vocab):
        for fmt, marks in _MARKS:
            if any(mark in source for mark in marks):
                return fmt
    return HERMES


def call_parser(fmt: ToolCallFormat, schemas: dict[str, Any]) -> StreamingCallParser:
    """A parser of one choice's text in `fmt`, taking calls to the tools of `schemas` only
    (name -> parameters' JSON schema, by which the XML format reads its values)."""
    if fmt is QWEN3_CODER:
        return XmlCallParser(schemas)
    return PythonicCallParser(set(schemas)) if fmt is PYTHONIC else ToolCallParser(fmt, set(schemas))
