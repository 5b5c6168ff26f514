"""Request bodies of the chat routes, as pydantic models: the conversation (messages, tool
calls, tools), how the chat template makes it a prompt (`ChatPrompt`, which /tokenize takes
too), and POST /v1/chat/completions. The rules of `protocol` hold here: every model refuses
fields it does not declare, and field-level checks live on the fields.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictStr, ValidationInfo, field_validator

from tokenizer_proc.protocol import (
    MAX_CHAT_TEMPLATE_CHARS,
    MAX_LOGPROBS,
    ResponseFormat,
    _SamplingFields,
    _Strict,
)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str
    """JSON text, as the model wrote it."""


class ToolCall(_Strict):
    """A call an earlier assistant turn made (sent back by the client in `messages`)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = None
    """An earlier assistant turn's reasoning, as this server answered it (clients send the
    message back whole): templates that render tools get it (Qwen3's reads it), others the
    answer text only."""

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        """A non-text part gets its own error, not one per way the content failed to parse."""
        for part in v if isinstance(v, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported: the served model reads text only")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments; None means no arguments."""
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: call that tool."""

    type: Literal["function"]
    function: NamedFunction


class ChatPrompt(_Strict):
    """A conversation and how the chat template makes it a prompt: what a chat completion and
    a /tokenize of messages share (vLLM's fields)."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool | None = None
    """End the prompt with the assistant turn's header, for the model to answer in a new turn.
    Unset: true, unless `continue_final_message` (read it through `generation_prompt()`)."""
    continue_final_message: bool = False
    """Leave the final message open, its end of turn cut off, so that the answer continues its
    text: an assistant reply the client has begun ("prefill"). Refused with an explicit
    `add_generation_prompt: true`, which would start a new turn instead."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (vLLM's field), e.g. {"enable_thinking": false}."""
    chat_template: StrictStr | None = Field(None, min_length=1, max_length=MAX_CHAT_TEMPLATE_CHARS)
    """vLLM's: a Jinja chat template for this request instead of the model's. Only on a server
    started with --trust-request-chat-template (it is code the server runs, if sandboxed)."""
    documents: list[dict[str, StrictStr]] | None = None
    """vLLM's: documents for a retrieval-augmented template (e.g. {"title", "text"}), passed
    to the template as `documents`; templates that do not read them ignore them."""
    add_special_tokens: bool = False
    """The template already writes the special tokens; True adds the tokenizer's on top."""

    @field_validator("continue_final_message")
    @classmethod
    def _one_way_to_end(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("add_generation_prompt"):
            raise ValueError(
                "continue_final_message continues the final message and add_generation_prompt starts a new "
                "assistant turn: set add_generation_prompt to false (or leave it out)"
            )
        return v

    def template_variables(self) -> dict[str, Any]:
        """The request's own variables for the chat template."""
        return dict(self.chat_template_kwargs or {})

    def generation_prompt(self) -> bool:
        if self.add_generation_prompt is None:
            return not self.continue_final_message
        return self.add_generation_prompt


class ChatCompletionRequest(_SamplingFields, ChatPrompt):
    """POST /v1/chat/completions."""

    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    """May the model call several tools at once: `auto` returns every call it writes either
    way; `required` allows several only when true (tools.forced_call_spec says why)."""
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    """OpenAI's: reaches the chat template as its `reasoning_effort` variable (as vLLM passes
    it), unless `chat_template_kwargs` sets that variable itself."""
    echo: bool = False
    """vLLM's: when the conversation ends with an assistant message (a reply the client began,
    with `continue_final_message`), the answer's content starts with that message's text."""

    def template_variables(self) -> dict[str, Any]:
        variables = super().template_variables()
        if self.reasoning_effort is not None:
            variables.setdefault("reasoning_effort", self.reasoning_effort)
        return variables

    def echoed_text(self) -> str:
        """What `echo` puts before the answer's content: the final message's text when it is
        the assistant's own."""
        final = self.messages[-1]
        return final.text() if self.echo and final.role == "assistant" else ""

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return v


class TokenizeChatRequest(ChatPrompt):
    """POST /tokenize of a conversation, rendered by the chat template as vLLM does."""

    model: str | None = None
    return_token_strs: bool = False
