"""The body of POST /v1/messages (Anthropic's Messages API), and what it means as a chat.

A Messages request is a chat completion in other words: `system` is a system message; a
message's content blocks are text, the model's earlier `tool_use` calls, the client's
`tool_result`s and the model's `thinking`; tools carry an `input_schema` where chat's carry
`parameters`. `MessagesRequest.chat_request` says it in chat's words, so that one path
(`openai_request.resolve_chat`) renders, constrains and samples all three APIs.

`cache_control` is accepted wherever Anthropic takes it and does nothing: the radix cache
reuses every prompt prefix without being asked. Content other than text (images,
documents), server tools and redacted thinking are a 400 naming their field.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, StrictStr, Tag, ValidationError, field_validator

from tokenizer_proc.chat_protocol import ChatCompletionRequest, ChatMessage, FunctionCall, TextPart, ToolCall
from tokenizer_proc.errors import APIError, validation_api_error
from tokenizer_proc.protocol import _Strict, by_type

CacheControl = dict[str, Any] | None
"""Anthropic's prompt-caching marker: accepted, and not needed (see the module docstring)."""


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl = None
    citations: list[Any] | None = None
    """Of an earlier answer, sent back as received; nothing reads them."""


class ToolUseBlock(_Strict):
    """A call the model made in an earlier turn."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl = None


class ToolResultBlock(_Strict):
    """What the client's tool returned for `tool_use_id`."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: StrictStr | list[TextBlock] = ""
    is_error: bool | None = None
    """Reaches the model as the result's text, prefixed "Error: "."""
    cache_control: CacheControl = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(_Strict):
    """The model's reasoning in an earlier turn: the template gets it as the assistant
    message's `reasoning_content` (Qwen3's reads it, others drop it)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    """Anthropic's proof that it wrote the thinking; this server neither signs nor checks."""
    cache_control: CacheControl = None


BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking")


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")],
    by_type("text"),
]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: StrictStr | list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _text_blocks_only(cls, v: Any) -> Any:
        """Another block type gets its own error, not one per way the content failed to parse."""
        for block in v if isinstance(v, list) else ():
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in BLOCK_TYPES:
                message = "are not supported: the served model reads text only"
                if kind == "redacted_thinking":
                    message = "cannot be read: this server neither writes nor decrypts redacted thinking"
                raise ValueError(f"content blocks of type {kind!r} {message}")
        return v

    def blocks(self) -> list[Any]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else list(self.content)


class ToolDefinition(_Strict):
    """A client tool (Anthropic's "custom" tool); server tools (web search, code execution,
    computer use, ...) have a `type` of their own and are refused."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    strict: bool | None = None
    cache_control: CacheControl = None

    def chat_function(self) -> dict[str, Any]:
        """The tool as chat's `function` object (`input_schema` is chat's `parameters`)."""
        function = {"name": self.name, "description": self.description, "parameters": self.input_schema}
        return {k: v for k, v in {**function, "strict": self.strict}.items() if v is not None}


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    """With `tool`: the tool the answer must call."""
    disable_parallel_tool_use: bool | None = None
    """True: at most one call (chat's `parallel_tool_calls: false`)."""


class ThinkingConfig(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)
    """Not enforced apart: `max_tokens` bounds the thinking and the answer together."""
    display: Literal["summarized", "omitted"] | None = None
    """Accepted: the thinking block carries the whole reasoning text."""


class JsonOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    """Reaches the chat template as its `reasoning_effort` variable."""
    format: JsonOutputFormat | None = None
    """The answer is constrained to this JSON schema (chat's `response_format`)."""


class Metadata(_Strict):
    user_id: str | None = None
    """An end-user id for the provider's abuse monitoring; nothing to monitor here."""


class MessagesRequest(_Strict):
    """POST /v1/messages."""

    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: StrictStr | list[TextBlock] | None = None
    stop_sequences: list[StrictStr] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    """Anthropic's range, 0 to 1; unset: 1.0."""
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    """A reasoning model's template gets `enable_thinking` (true unless disabled)."""
    output_config: OutputConfig | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    """Accepted no-op: there is one tier."""
    cache_control: CacheControl = None

    @field_validator("tool_choice")
    @classmethod
    def _tool_named(cls, v: ToolChoice | None) -> ToolChoice | None:
        if v is not None and (v.type == "tool") != (v.name is not None):
            raise ValueError("tool_choice names a tool exactly when its type is `tool`")
        return v

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "".join(b.text for b in self.system)

    def chat_request(self) -> ChatCompletionRequest:
        """This request as a chat completion."""
        system = self.system_text()
        messages = [ChatMessage(role="system", content=system)] if system else []
        for message in self.messages:
            messages += chat_messages(message)
        chat: dict[str, Any] = {
            "messages": messages,
            "model": self.model,
            "max_tokens": self.max_tokens,
            "stream": self.stream,
            "stop": self.stop_sequences or None,
        }
        for knob in ("temperature", "top_p", "top_k"):
            if getattr(self, knob) is not None:
                chat[knob] = getattr(self, knob)
        if self.tools:
            chat["tools"] = [{"type": "function", "function": t.chat_function()} for t in self.tools]
        if self.tool_choice is not None:
            chat["tool_choice"] = _chat_tool_choice(self.tool_choice)
            if self.tool_choice.disable_parallel_tool_use:
                chat["parallel_tool_calls"] = False
        if self.thinking is not None:
            chat["chat_template_kwargs"] = {"enable_thinking": self.thinking.type != "disabled"}
        if self.output_config is not None:
            if self.output_config.effort is not None:
                chat["chat_template_kwargs"] = {
                    **chat.get("chat_template_kwargs", {}),
                    "reasoning_effort": self.output_config.effort,
                }
            if self.output_config.format is not None:
                schema = {"name": "output", "schema": self.output_config.format.schema_}
                chat["response_format"] = {"type": "json_schema", "json_schema": schema}
        try:
            return ChatCompletionRequest.model_validate(chat)
        except ValidationError as e:  # what only the chat request checks
            raise validation_api_error(e.errors()).in_words_of(MESSAGES_PARAM) from e


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a message request's prompt, whose answer is not made."""

    max_tokens: int = Field(1, ge=1)
    """Not needed: the count is the prompt's."""


MESSAGES_PARAM = {"stop": "stop_sequences", "response_format": "output_config", "parameters": "tools"}
"""The chat request's fields, by the Messages field they came from."""


def _chat_tool_choice(choice: ToolChoice) -> Any:
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"any": "required"}.get(choice.type, choice.type)


def chat_messages(message: Message) -> list[ChatMessage]:
    """One Messages-API message as chat messages: a user's tool results become tool
    messages (in their order among its text), an assistant's blocks one assistant message
    (thinking, text, calls)."""
    if message.role == "assistant":
        reasoning = "".join(b.thinking for b in message.blocks() if isinstance(b, ThinkingBlock))
        text = [TextPart(type="text", text=b.text) for b in message.blocks() if isinstance(b, TextBlock)]
        calls = [
            ToolCall(id=b.id, function=FunctionCall(name=b.name, arguments=json.dumps(b.input)))
            for b in message.blocks()
            if isinstance(b, ToolUseBlock)
        ]
        return [
            ChatMessage(
                role="assistant", content=text or None, tool_calls=calls or None, reasoning_content=reasoning or None
            )
        ]
    out: list[ChatMessage] = []
    for block in message.blocks():
        if isinstance(block, ToolResultBlock):
            out.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=block.text()))
        elif isinstance(block, TextBlock):
            last = out[-1] if out else None
            if last is not None and last.role == "user" and isinstance(last.content, list):
                last.content.append(TextPart(type="text", text=block.text))
            else:
                out.append(ChatMessage(role="user", content=[TextPart(type="text", text=block.text)]))
        else:
            raise APIError(f"A user message cannot hold a {block.type} block.", param="messages")
    return out
