"""Decoding constraints from a request: `response_format`, SGLang's `regex`/`ebnf`/`json_schema`,
vLLM's `structured_outputs`, `logit_bias`; each checked here so that bad input is a 400 naming the problem.

The constraint leaves this process as text (`GrammarSpec`); the worker compiles it against
the vocabulary and owns the matcher (gpu_worker/runtime/grammar.py). A reasoning model's
constraint starts after its thinking (`after_reasoning`). Parsing it here needs no
vocabulary and catches what the library would refuse (a bad schema, regex or grammar),
with the library's own reason.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from tokenizer_proc.errors import APIError
from tokenizer_proc.reasoning import THINK_CLOSE, THINK_OPEN
from trident.wire.frontend import GrammarSpec

if TYPE_CHECKING:
    import xgrammar

    from tokenizer_proc.protocol import StructuredOutputs

ANY_JSON_OBJECT = '{"type": "object"}'
"""`response_format: {"type": "json_object"}`: any JSON object (OpenAI's meaning)."""

LOGIT_BIAS_LIMIT = 100.0

_LIBRARY_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def library_reason(err: Exception) -> str:
    """The grammar library's reason, without its log timestamp and C++ source location."""
    return _LIBRARY_LOG_PREFIX.sub("", str(err).strip()).strip()


GRAMMAR_ERRORS = (RuntimeError, ValueError, TypeError)
"""What xgrammar raises for a schema, regex or grammar it refuses."""


def grammar_of(spec: GrammarSpec) -> xgrammar.Grammar:
    """The grammar the worker will compile `spec` to (gpu_worker/runtime/grammar.py, with the
    same JSON options); raises GRAMMAR_ERRORS when the library refuses it."""
    # Imported on the first grammar, not at start-up: xgrammar imports torch, which this
    # process otherwise never loads (torchless.py); that first request waits for it once.
    import xgrammar

    if spec.kind == "json_schema":
        return xgrammar.Grammar.from_json_schema(spec.text, any_whitespace=False, strict_mode=spec.strict)
    if spec.kind == "regex":
        return xgrammar.Grammar.from_regex(spec.text)
    if spec.kind == "ebnf":
        return xgrammar.Grammar.from_ebnf(spec.text)
    raise ValueError(f"unknown grammar kind {spec.kind!r}")


@lru_cache(maxsize=256)
def _parse(spec: GrammarSpec) -> str:
    """'' if `spec` parses, else the library's reason (cached: clients reuse schemas)."""
    try:
        grammar_of(spec)
    except GRAMMAR_ERRORS as e:
        return library_reason(e)
    return ""


def after_reasoning(spec: GrammarSpec, thinking_open: bool) -> GrammarSpec:
    """`spec` for a reasoning model: free text up to and including `</think>` (already open
    when the prompt opened it; else an optional `<think>...</think>` block), whitespace,
    then the constraint. The thinking itself is never constrained."""
    import xgrammar

    def tag(begin: str) -> xgrammar.Grammar:
        text = {"type": "any_text", "excludes": [THINK_CLOSE]}
        fmt = {"type": "tag", "begin": begin, "content": text, "end": THINK_CLOSE}
        return xgrammar.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": fmt}))

    body = grammar_of(spec)
    whitespace = xgrammar.Grammar.from_ebnf("root ::= [ \\t\\n]*")
    if thinking_open:
        grammar = xgrammar.Grammar.concat(tag(""), whitespace, body)
    else:
        grammar = xgrammar.Grammar.union(xgrammar.Grammar.concat(tag(THINK_OPEN), whitespace, body), body)
    return GrammarSpec("ebnf", str(grammar))


def checked(spec: GrammarSpec, param: str) -> GrammarSpec:
    reason = _parse(spec)
    if reason:
        raise APIError(f"Invalid {param}: {reason}", param=param, code="invalid_grammar")
    return spec


def schema_spec(schema: Any, param: str, strict: bool = True) -> GrammarSpec:
    """A JSON schema given as an object or as JSON text."""
    if isinstance(schema, str):
        text = schema
    elif isinstance(schema, Mapping):
        text = json.dumps(schema)
    else:
        raise APIError(f"{param} must be a JSON schema object.", param=param, code="invalid_grammar")
    return checked(GrammarSpec("json_schema", text, strict), param)


def response_format_spec(response_format: Any) -> GrammarSpec | None:
    """OpenAI's `response_format` (already shape-checked by protocol.ResponseFormat)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return checked(GrammarSpec("json_schema", ANY_JSON_OBJECT, strict=False), "response_format")
    js = response_format.json_schema
    if js is None or js.schema_ is None:
        raise APIError(
            "response_format of type json_schema needs json_schema.schema.", param="response_format.json_schema"
        )
    return schema_spec(js.schema_, "response_format.json_schema.schema", strict=bool(js.strict))


def one_constraint(candidates: Mapping[str, GrammarSpec | None]) -> GrammarSpec | None:
    """The one constraint a request asks for (keyed by the field that asked for it); two at
    once is a 400 naming both."""
    given = [(name, spec) for name, spec in candidates.items() if spec is not None]
    if len(given) > 1:
        names = " and ".join(name for name, _ in given)
        raise APIError(f"Give at most one decoding constraint; got {names}.", param=given[1][0])
    return given[0][1] if given else None


def sglang_constraint(regex: str | None, ebnf: str | None, json_schema: Any) -> GrammarSpec | None:
    """SGLang's `regex` / `ebnf` / `json_schema` fields (the schema as JSON text or an object)."""
    return one_constraint(
        {
            "regex": checked(GrammarSpec("regex", regex), "regex") if regex is not None else None,
            "ebnf": checked(GrammarSpec("ebnf", ebnf), "ebnf") if ebnf is not None else None,
            "json_schema": schema_spec(json_schema, "json_schema") if json_schema is not None else None,
        }
    )


def vllm_constraint(outputs: StructuredOutputs | None, legacy: bool = False) -> GrammarSpec | None:
    """vLLM's `structured_outputs` object; it must name exactly one constraint. `legacy`: it
    stands for the `guided_*` fields (`guided_outputs`), which errors then name."""
    if outputs is None:
        return None
    at = "structured_outputs"

    def param(field: str) -> str:
        return f"guided_{field}" if legacy else f"{at}.{field}"

    given: dict[str, GrammarSpec | None] = {}
    if outputs.json_ is not None:
        given[param("json")] = schema_spec(outputs.json_, param("json"))
    if outputs.regex is not None:
        given[param("regex")] = checked(GrammarSpec("regex", outputs.regex), param("regex"))
    if outputs.choice is not None:
        given[param("choice")] = checked(GrammarSpec("ebnf", choice_grammar(outputs.choice)), param("choice"))
    if outputs.grammar is not None:
        given[param("grammar")] = checked(GrammarSpec("ebnf", outputs.grammar), param("grammar"))
    if outputs.json_object:
        given[param("json_object")] = GrammarSpec("json_schema", ANY_JSON_OBJECT, strict=False)
    if not given:
        raise APIError(f"{at} needs one of json, regex, choice, grammar or json_object.", param=at)
    return one_constraint(given)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices` (each a JSON-escaped literal)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def logit_bias_pairs(bias: Mapping[str, float] | None, vocab_size: int) -> list[tuple[int, float]]:
    """OpenAI's `logit_bias` ({"token id": bias in [-100, 100]}) -> sorted (id, bias) pairs."""
    if not bias:
        return []
    pairs = []
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(f"logit_bias keys must be token ids, got {key!r}.", param="logit_bias") from None
        if not 0 <= token < vocab_size:
            raise APIError(f"logit_bias names token {token}, outside [0, {vocab_size}).", param="logit_bias")
        if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise APIError(f"logit_bias values must be in [-100, 100], got {value}.", param="logit_bias")
        pairs.append((token, float(value)))
    return sorted(pairs)
