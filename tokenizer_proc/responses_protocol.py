"""The body of POST /v1/responses (OpenAI's Responses API), and what it means as a chat.

A Responses request is a chat completion in other words: `input` is a list of items
(messages, the model's earlier function calls, their outputs, its reasoning) where chat has
messages; `instructions` is a system message that is not carried to the next turn;
`text.format` is chat's `response_format`; tools are flat (`{"type": "function", "name",
...}`). `ResponsesRequest.chat_request` says it in chat's words, so that one path
(`openai_api.resolve_chat`) renders, constrains and samples both.

Only function tools, text content and `truncation: "disabled"` are served; anything else is a
400 naming its field (the models here are strict, as in `protocol`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictStr, Tag, TypeAdapter, ValidationError, field_validator

from tokenizer_proc.chat_protocol import ChatCompletionRequest, ChatMessage, FunctionCall, ToolCall
from tokenizer_proc.errors import APIError, validation_api_error
from tokenizer_proc.protocol import (
    MAX_CACHE_SALT_CHARS,
    MAX_LOGPROBS,
    MAX_REQUEST_ID_CHARS,
    _AcceptedNoOps,
    _OpenAIKnobs,
    _Strict,
    by_type,
)
from trident.wire.frontend import INT32_MAX

OUTPUT_TEXT_LOGPROBS = "message.output_text.logprobs"
"""The output text's token logprobs, as `include` asks for them."""


class TextContent(_Strict):
    """A part of a message's content: what the user wrote (`input_text`) or the model answered
    (`output_text`, as an earlier response's message is sent back)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None
    """Of `output_text`: sent back as received; nothing reads them."""
    logprobs: list[dict[str, Any]] | None = None
    """Of `output_text`: sent back as received; nothing reads them."""

    @field_validator("type", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        if isinstance(v, str) and v not in ("input_text", "output_text"):
            raise ValueError(f"content parts of type {v!r} are not supported: the served model reads text only")
        return v


class MessageItem(_Strict):
    """A message of the conversation (OpenAI's EasyInputMessage and output message)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: StrictStr | list[TextContent]
    id: str | None = None
    status: str | None = None
    phase: str | None = None
    """Of an earlier response's message, sent back as received."""

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    """A call the model made in an earlier response."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    """What the client's function returned for `call_id`."""

    type: Literal["function_call_output"]
    call_id: str
    output: StrictStr | list[TextContent]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningText(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Strict):
    """The model's reasoning in an earlier response: it reaches the template as the next
    assistant message's `reasoning_content` (Qwen3's template reads it, others drop it)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None

    @field_validator("encrypted_content")
    @classmethod
    def _not_encrypted(cls, v: str | None) -> str | None:
        if v is not None:
            raise ValueError("this server neither writes nor reads encrypted reasoning: send its `content` instead")
        return v

    def text(self) -> str:
        return "".join(p.text for p in self.content or self.summary)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    by_type("message"),
]

INPUT_ITEMS: TypeAdapter[list[Any]] = TypeAdapter(list[InputItem])
"""Parses a list of input items (the store parses a response's output items back with it)."""


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    """`text.format`: chat's `response_format`, with the JSON schema's fields flat."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    """Accepted no-op: a hint for OpenAI's models; the served model has no such control."""


class ReasoningConfig(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    """Reaches the chat template as its `reasoning_effort` variable, as vLLM passes it."""
    summary: Literal["auto", "concise", "detailed"] | None = None
    """Accepted: the reasoning item carries the whole reasoning text (`content`), no summary."""
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    """The older name of `summary`."""


class ResponseStreamOptions(_Strict):
    include_obfuscation: bool | None = None
    """Accepted no-op: this server adds no obfuscation padding to stream events."""


class ResponsesRequest(_AcceptedNoOps, _OpenAIKnobs):
    """POST /v1/responses. The sampling knobs (temperature, top_p, and vLLM's top_k, seed, ...)
    are chat's; `store` is not a no-op here (`responses_store`)."""

    input: StrictStr | list[InputItem] = Field(default_factory=list)
    """A user message, or the conversation's new items (after `previous_response_id`'s)."""
    model: str | None = None
    instructions: str | None = None
    """A system message before the conversation, for this response only."""
    previous_response_id: StrictStr | None = None
    """A stored response whose conversation (inputs and outputs, back to its first) this one
    continues; its instructions are not carried over."""
    store: bool = True
    """Keep the response, for GET /v1/responses/{id} and as a later `previous_response_id`."""
    stream: bool = False
    stream_options: ResponseStreamOptions | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[Literal["message.output_text.logprobs", "reasoning.encrypted_content"]] | None = None
    """`message.output_text.logprobs`; `reasoning.encrypted_content` is accepted and adds
    nothing: clients ask for it to send the reasoning back without a stored response, and the
    reasoning item's plain `content` serves that (this server encrypts nothing)."""
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """With `include: ["message.output_text.logprobs"]`: the top logprobs of each token."""
    truncation: Literal["disabled"] = "disabled"
    """The prompt is never cut: one longer than the context is a 400."""
    background: bool = False
    """OpenAI's: the answer comes at once, `queued`, and the response is made detached; GET
    /v1/responses/{id} shows how it stands, POST /v1/responses/{id}/cancel stops it. It needs
    `store` (the default) and is not streamed."""
    request_id: StrictStr | None = Field(None, min_length=1, max_length=MAX_REQUEST_ID_CHARS)
    """vLLM's: the response's id is `resp_<it>`, and POST /abort with that id stops it."""
    priority: int = Field(0, ge=-INT32_MAX, le=INT32_MAX)
    cache_salt: StrictStr | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)

    def input_items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def logprobs_wanted(self) -> bool:
        return OUTPUT_TEXT_LOGPROBS in (self.include or ())

    def chat_request(self, history: list[Any]) -> ChatCompletionRequest:
        """This request as a chat completion, its conversation `history` (the earlier
        responses' items) then its own input."""
        messages = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        messages += chat_messages(history + self.input_items())
        if not messages:
            raise APIError("`input` is empty: a response needs a message to answer.", param="input")
        chat: dict[str, Any] = {
            **self.model_dump(include=set(_OpenAIKnobs.model_fields), exclude_unset=True),
            "messages": messages,
            "model": self.model,
            "max_completion_tokens": self.max_output_tokens,
            "parallel_tool_calls": self.parallel_tool_calls,
            "logprobs": self.logprobs_wanted(),
            "top_logprobs": self.top_logprobs if self.logprobs_wanted() else None,
            "stream": self.stream,
            "request_id": self.request_id,
            "priority": self.priority,
            "cache_salt": self.cache_salt,
        }
        if self.tools:
            chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"})} for t in self.tools]
        if isinstance(self.tool_choice, NamedFunctionChoice):
            chat["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            chat["tool_choice"] = self.tool_choice
        if self.text and self.text.format:
            chat["response_format"] = _response_format(self.text.format)
        if self.reasoning and self.reasoning.effort:
            chat["reasoning_effort"] = self.reasoning.effort
        try:
            return ChatCompletionRequest.model_validate(chat)
        except ValidationError as e:  # what only the chat request checks (e.g. a schema without a name)
            raise validation_api_error(e.errors()).in_words_of(RESPONSES_PARAM) from e


RESPONSES_PARAM = {"messages": "input", "response_format": "text", "max_completion_tokens": "max_output_tokens"}
"""The chat request's fields, by the Responses field they came from."""


def _response_format(f: TextFormat) -> dict[str, Any]:
    if f.type != "json_schema":
        return {"type": f.type}
    schema = {"name": f.name, "schema": f.schema_, "description": f.description, "strict": f.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def chat_messages(items: list[Any]) -> list[ChatMessage]:
    """A conversation's items as chat messages: consecutive function calls become one
    assistant message's tool calls (the assistant's text before them, if any, included), an
    output a tool message, and reasoning the `reasoning_content` of the assistant message
    that follows it."""
    messages: list[ChatMessage] = []
    reasoning: str | None = None
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning = (reasoning or "") + item.text()
            continue
        if isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and reasoning is None:
                last.tool_calls = [*(last.tool_calls or []), call]
                continue
            messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=item.text()))
        else:
            messages.append(ChatMessage(role=item.role, content=item.text()))
        if messages[-1].role == "assistant" and reasoning is not None:
            messages[-1].reasoning_content = reasoning
        reasoning = None
    return messages
