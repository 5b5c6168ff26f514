"""The constraint a forced `tool_choice` (`required` or a named function) puts on decoding:
calls written in the served model's own format, so that the family's parser reads them and
the model writes what it was trained to write:

- hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, blocks one per line;
- llama3_json: `{"name": ..., "parameters": {...}}`, several separated by `; `;
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- pythonic: `[name(key=value, ...), ...]`, each value a literal of its parameter's type;
- qwen3_coder: `<tool_call>` blocks of `<function=name>` and `<parameter=key>` elements,
  one per line (xml_calls.py).

A named function allows exactly one call; `required` one, or one or more with
`parallel_tool_calls: true`. The JSON objects follow each tool's parameter schema; the pythonic list
checks the keyword names and the type of each value, not which keywords are required.
The grammar leaves here as EBNF text (the worker compiles it like any `ebnf` constraint).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tokenizer_proc.errors import APIError
from tokenizer_proc.pythonic_calls import PYTHONIC, python_literal
from tokenizer_proc.structured import GRAMMAR_ERRORS, grammar_of, library_reason
from tokenizer_proc.tool_parsers import HERMES, LLAMA3_JSON, MISTRAL, ToolCallFormat
from tokenizer_proc.xml_calls import CLOSE, OPEN, QWEN3_CODER, xml_value_text
from trident.wire.frontend import GrammarSpec

NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


def call_object_schema(tools: list[dict[str, Any]], arguments_key: str) -> dict[str, Any]:
    """The JSON schema of one call object `{"name": ..., arguments_key: {...}}` to one of `tools`."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t["name"]}, arguments_key: t.get("parameters") or NO_ARGUMENTS},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def family_calls_spec(tools: list[dict[str, Any]], fmt: ToolCallFormat, single: bool) -> GrammarSpec:
    """EBNF of calls to `tools` written in `fmt`: one call when `single`, else one or more.
    Raises GRAMMAR_ERRORS for a parameter schema the grammar library refuses."""
    import xgrammar

    if fmt is PYTHONIC:
        return GrammarSpec("ebnf", pythonic_calls_ebnf(tools, single))
    if fmt is QWEN3_CODER:
        return GrammarSpec("ebnf", xml_calls_ebnf(tools, single))
    call = _json_ebnf(call_object_schema(tools, fmt.arguments_key))
    if fmt is MISTRAL:
        array = {"type": "array", "items": call_object_schema(tools, fmt.arguments_key), "minItems": 1}
        if single:
            array["maxItems"] = 1
        structure: dict[str, Any] = {
            "type": "sequence",
            "elements": [{"type": "const_string", "value": "[TOOL_CALLS]"}, _grammar_format(_json_ebnf(array))],
        }
    else:
        begin, end, separator = ("<tool_call>\n", "\n</tool_call>", "\n") if fmt is HERMES else ("", "", "; ")
        assert fmt in (HERMES, LLAMA3_JSON), fmt.name
        structure = {
            "type": "tags_with_separator",
            "tags": [{"type": "tag", "begin": begin, "content": _grammar_format(call), "end": end}],
            "separator": separator,
            "at_least_one": True,
            "stop_after_first": single,
        }
    tag = json.dumps({"type": "structural_tag", "format": structure})
    return GrammarSpec("ebnf", str(xgrammar.Grammar.from_structural_tag(tag)))


def checked_family_calls_spec(tools: list[dict[str, Any]], fmt: ToolCallFormat, single: bool) -> GrammarSpec:
    """family_calls_spec, with a refused parameter schema answered as a 400."""
    try:
        return family_calls_spec(tools, fmt, single)
    except GRAMMAR_ERRORS as e:
        raise APIError(f"Invalid tools: {library_reason(e)}", param="tools", code="invalid_grammar") from e


def _json_ebnf(schema: dict[str, Any]) -> str:
    """The schema's grammar as the worker would build it (no free whitespace)."""
    return str(grammar_of(GrammarSpec("json_schema", json.dumps(schema), strict=True)))


def _grammar_format(ebnf: str) -> dict[str, Any]:
    return {"type": "grammar", "grammar": ebnf}


def _enum_rule(schema: dict[str, Any], written: Callable[[Any], str]) -> str | None:
    """The alternatives of a schema's `enum`, each value as the family writes it; None: no enum."""
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return "(" + " | ".join(json.dumps(written(v)) for v in schema["enum"]) + ")"
    return None


# ---- pythonic ------------------------------------------------------------------------------

_PYTHON_VALUES = r"""
py_value ::= py_string | py_number | "True" | "False" | "None" | py_list | py_dict
py_string ::= "\"" ([^"\\\n] | "\\" [^\n])* "\""
py_int ::= "-"? [0-9]+
py_number ::= py_int ("." [0-9]+)? ([eE] [+\-]? [0-9]+)?
py_bool ::= "True" | "False"
py_list ::= "[" (py_value ("," " " py_value)*)? "]"
py_dict ::= "{" (py_string ":" " " py_value ("," " " py_string ":" " " py_value)*)? "}"
"""
_TYPED_VALUES = {"string": "py_string", "integer": "py_int", "number": "py_number", "boolean": "py_bool"}


def pythonic_calls_ebnf(tools: list[dict[str, Any]], single: bool) -> str:
    """`[call]` or `[call, call, ...]`, each call `name(keyword=value, ...)` with a value of
    its parameter's JSON type (py_value where the schema says no plain type)."""
    rules = ['root ::= "[" call "]"' if single else 'root ::= "[" call ("," " " call)* "]"']
    rules.append("call ::= " + " | ".join(f"call_{i}" for i in range(len(tools))))
    for i, tool in enumerate(tools):
        properties = (tool.get("parameters") or NO_ARGUMENTS).get("properties") or {}
        head = json.dumps(f"{tool['name']}(")
        if not properties:
            rules.append(f'call_{i} ::= {head} ")"')
            continue
        rules.append(f'call_{i} ::= {head} (arg_{i} ("," " " arg_{i})*)? ")"')
        keywords = [f"{json.dumps(name + '=')} {_python_value_rule(schema)}" for name, schema in properties.items()]
        rules.append(f"arg_{i} ::= " + " | ".join(f"({k})" for k in keywords))
    return "\n".join(rules) + _PYTHON_VALUES


def _python_value_rule(schema: Any) -> str:
    if not isinstance(schema, dict):
        return "py_value"
    enum = _enum_rule(schema, python_literal)
    if enum is not None:
        return enum
    kind = schema.get("type")
    if kind == "array":
        item = _python_value_rule(schema.get("items"))
        return f'("[" ({item} ("," " " {item})*)? "]")'
    if kind == "null":
        return '"None"'
    return _TYPED_VALUES.get(kind, "py_value") if isinstance(kind, str) else "py_value"


# ---- qwen3_coder ---------------------------------------------------------------------------

_XML_VALUES = r"""
xml_text ::= ([^<] | "<" [^/])*
json_value ::= json_object | json_array | json_string | json_number | "true" | "false" | "null"
json_object ::= "{" (json_string ":" " "? json_value ("," " "? json_string ":" " "? json_value)*)? "}"
json_array ::= "[" (json_value ("," " "? json_value)*)? "]"
json_string ::= "\"" ([^"\\\n] | "\\" [^\n])* "\""
json_int ::= "-"? [0-9]+
json_number ::= json_int ("." [0-9]+)? ([eE] [+\-]? [0-9]+)?
"""
_XML_TYPED_VALUES = {
    "string": "xml_text",
    "integer": "json_int",
    "number": "json_number",
    "boolean": '("true" | "false")',
    "null": '"null"',
    "object": "json_object",
    "array": "json_array",
}


def xml_calls_ebnf(tools: list[dict[str, Any]], single: bool) -> str:
    """One block, or blocks one per line, each a call to one of `tools` whose parameters are
    its own, each value of its type (text for strings, JSON for the rest). As for the pythonic
    list, which parameters are required is not checked."""
    rules = ["root ::= call" if single else 'root ::= call ("\\n" call)*']
    rules.append("call ::= " + " | ".join(f"call_{i}" for i in range(len(tools))))
    for i, tool in enumerate(tools):
        head = json.dumps(f"{OPEN}\n<function={tool['name']}>\n")
        tail = json.dumps(f"</function>\n{CLOSE}")
        properties = (tool.get("parameters") or {}).get("properties") or {}
        if not properties:
            rules.append(f"call_{i} ::= {head} {tail}")
            continue
        rules.append(f"call_{i} ::= {head} param_{i}* {tail}")
        options = [
            f'({json.dumps(f"<parameter={name}>" + chr(10))} {_xml_value_rule(schema)} "\\n</parameter>\\n")'
            for name, schema in properties.items()
        ]
        rules.append(f"param_{i} ::= " + " | ".join(options))
    return "\n".join(rules) + _XML_VALUES


def _xml_value_rule(schema: Any) -> str:
    if not isinstance(schema, dict):
        return "xml_text"
    enum = _enum_rule(schema, xml_value_text)
    if enum is not None:
        return enum
    kind = schema.get("type")
    return _XML_TYPED_VALUES.get(kind, "xml_text") if isinstance(kind, str) else "xml_text"
