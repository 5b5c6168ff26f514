"""Tool calls on chat completions: the plan, the prompt and the constraint (the output is
parsed by `tool_parsers`, in the served model's format).

- The tool definitions reach the model through its own chat template when the template
  renders `tools`; a template that does not (SmolLM2's) gets them in the system message,
  with the call format the output will be parsed in (Hermes' `<tool_call>` by default).
- `tool_choice` "required" or a named function constrains decoding to calls in the model's
  own format, whose arguments follow the tool's parameter schema (tool_grammar.py; the
  grammar is enforced on the worker like any other constraint).
- "auto" leaves decoding free and parses what the model wrote in its family's format;
  anything else is the answer text. "none" (or no tools) neither renders nor parses tools.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenizer_proc.chat_protocol import ChatCompletionRequest, ChatMessage
from tokenizer_proc.errors import APIError
from tokenizer_proc.structured import schema_spec
from tokenizer_proc.tool_grammar import call_object_schema, checked_family_calls_spec
from tokenizer_proc.tool_parsers import ToolCallFormat
from trident.wire.frontend import GrammarSpec


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asks of tools; `mode` is none | auto | required | named."""

    tools: list[dict[str, Any]]
    """The `function` objects of the request's tools."""
    mode: str
    name: str | None = None
    """The forced function (mode named)."""

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


def plan_of(body: ChatCompletionRequest) -> ToolPlan:
    tools = [t.function.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools:
        if choice not in ("none", "auto"):
            raise APIError("tool_choice needs `tools`.", param="tool_choice")
        return ToolPlan([], "none")
    if isinstance(choice, str):
        return ToolPlan(tools, choice)
    name = choice.function.name
    if name not in {t["name"] for t in tools}:
        raise APIError(f"tool_choice names `{name}`, which is not one of the tools.", param="tool_choice")
    return ToolPlan(tools, "named", name)


def forced_call_spec(plan: ToolPlan, fmt: ToolCallFormat | None, parallel: bool | None) -> GrammarSpec:
    """The constraint of a forced tool choice: calls in the model's format `fmt`
    (tool_grammar.py), or one bare call object where no parser reads the family's format.
    `required` allows parallel calls only when the request sets `parallel_tool_calls: true`:
    a small model, once free to add a call, tends to repeat its call until the length limit."""
    allowed = [t for t in plan.tools if plan.mode == "required" or t["name"] == plan.name]
    if fmt is None:
        return schema_spec(call_object_schema(allowed, "arguments"), "tools")
    return checked_family_calls_spec(allowed, fmt, single=plan.mode == "named" or parallel is not True)


def template_renders_tools(template: str | None) -> bool:
    return "tools" in (template or "")


def template_messages(
    messages: list[ChatMessage], plan: ToolPlan, native_tools: bool, fmt: ToolCallFormat
) -> list[dict[str, Any]]:
    """The conversation as the chat template takes it; tools in the system message, and
    earlier calls written in `fmt`, when the template would not render them."""
    out = [_message_dict(m, native_tools, fmt) for m in messages]
    if plan.mode == "none" or native_tools:
        return out
    listing = "\n".join(json.dumps({"type": "function", "function": t}) for t in plan.tools)
    example = fmt.calls_text([("<function name>", "<arguments object>")])
    prompt = f"You may call the tools below. To call one, answer with only {example}\n<tools>\n{listing}\n</tools>"
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def _message_dict(m: ChatMessage, native_tools: bool, fmt: ToolCallFormat) -> dict[str, Any]:
    role = "system" if m.role == "developer" else m.role
    if native_tools:
        d: dict[str, Any] = {"role": role, "content": m.text()}
        if m.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning_content:
            d["reasoning_content"] = m.reasoning_content
        return d
    if role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"}
    calls = fmt.calls_text([(json.dumps(c.function.name), c.function.arguments) for c in m.tool_calls or []])
    return {"role": role, "content": m.text() + calls}
