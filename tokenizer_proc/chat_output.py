"""One chat choice's output as the client sees it: reasoning, content and tool calls.

The detokenized text goes through the reasoning parser (when the model reasons), and the
answer part through the tool-call parser (when tools are in play); what comes out is a
stream delta per piece. A non-streamed choice is the same object fed its whole text once,
so both answers agree. A `tool_calls` delta opens a call (its index, id and name) or adds
to the arguments of the last one.
"""

from __future__ import annotations

from typing import Any

from tokenizer_proc.reasoning import ReasoningParser, thinking_open_in
from tokenizer_proc.tool_formats import call_parser
from tokenizer_proc.tool_parsers import FORCED, Call, StreamingCallParser, ToolCallFormat
from tokenizer_proc.tools import ToolPlan


class ChoiceOutput:
    """A choice's reasoning, content and calls so far, and the deltas that send them."""

    def __init__(
        self,
        reasoning: ReasoningParser | None,
        tools: StreamingCallParser | None,
        model_reasons: bool = False,
    ) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._model_reasons = model_reasons
        """The message always has `reasoning_content` (null when there was none)."""
        self.reasoning_text = ""
        self.content = ""
        self.calls: list[Call] = []
        self.finish_reason: str | None = None
        """The client's: `tool_calls` once a choice that made calls stops."""

    def feed(self, text: str, finish_reason: str | None = None) -> dict[str, Any]:
        """The delta for this piece of text (empty when all of it is held back); with
        `finish_reason`, also everything held."""
        events = self._reasoning.feed(text) if self._reasoning else [("content", text)]
        if finish_reason is not None and self._reasoning:
            events += self._reasoning.finish()
        out: list[tuple[str, Any]] = []
        for kind, value in events:
            if kind == "content" and self._tools:
                out += self._tools.feed(value)
            elif value:
                out.append((kind, value))
        if finish_reason is not None:
            if self._tools:
                out += self._tools.finish(complete=finish_reason == "stop")
            stopped_with_calls = finish_reason == "stop" and (self.calls or any(k == "call" for k, _ in out))
            self.finish_reason = "tool_calls" if stopped_with_calls else finish_reason
        return self._delta(out)

    def _delta(self, events: list[tuple[str, Any]]) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        for kind, value in events:
            if kind == "reasoning":
                self.reasoning_text += value
                delta["reasoning_content"] = delta.get("reasoning_content", "") + value
            elif kind == "content":
                self.content += value
                delta["content"] = delta.get("content", "") + value
            elif kind == "call":  # the delta's copy and the message's grow apart
                delta.setdefault("tool_calls", []).append(
                    {"index": len(self.calls), **value, "function": dict(value["function"])}
                )
                self.calls.append({**value, "function": dict(value["function"])})
            else:  # more arguments text of the last call
                self.calls[-1]["function"]["arguments"] += value
                entries = delta.setdefault("tool_calls", [])
                if entries and entries[-1]["index"] == len(self.calls) - 1:
                    function = entries[-1]["function"]
                    entries[-1] = {**entries[-1], "function": {**function, "arguments": function["arguments"] + value}}
                else:
                    entries.append({"index": len(self.calls) - 1, "function": {"arguments": value}})
        return delta

    def message(self) -> dict[str, Any]:
        """The non-streamed `message`: content is null beside calls when the model wrote none."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content or (None if self.calls else "")}
        if self.calls:
            message["tool_calls"] = self.calls
        if self._model_reasons:
            message["reasoning_content"] = self.reasoning_text or None
        return message


def choice_output(
    plan: ToolPlan, tool_format: ToolCallFormat | None, model_reasons: bool, prompt_text: str
) -> ChoiceOutput:
    """The parsers one choice's text goes through: calls in the served model's format (a
    forced call without one is the bare object its grammar makes; none: calls stay text),
    after the reasoning when the model reasons (a constraint starts after it too)."""
    schemas = {t["name"]: t.get("parameters") for t in plan.tools}
    tools: StreamingCallParser | None = None
    if plan.forced:
        if plan.mode != "required":
            schemas = {plan.name or "": schemas.get(plan.name or "")}
        tools = call_parser(tool_format or FORCED, schemas)
    elif plan.mode == "auto" and tool_format is not None:
        tools = call_parser(tool_format, schemas)
    reasoning = ReasoningParser(thinking_open_in(prompt_text)) if model_reasons else None
    return ChoiceOutput(reasoning, tools, model_reasons)
