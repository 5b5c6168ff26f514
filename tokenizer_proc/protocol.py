"""Request bodies of the HTTP API, as pydantic models.

Field-level checks (types, ranges) live here, so FastAPI reports them as validation
errors (turned into 400s by `errors`). Checks that need the served model (context length,
vocabulary size, model name) live in `sampling`, which runs after tokenization.
Unknown fields are ignored, as OpenAI clients send many we do not use (`user`, ...).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationInfo, field_validator

MAX_STOP_STRINGS = 4
MAX_N = 16
MAX_LOGPROBS = 20
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1


def check_stop(v: str | list[str] | None) -> str | list[str] | None:
    """OpenAI semantics: up to 4 non-empty stop strings."""
    if isinstance(v, list):
        if len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed, got {len(v)}")
        if any(s == "" for s in v):
            raise ValueError("stop sequences must not be empty")
    elif v == "":
        raise ValueError("stop sequences must not be empty")
    return v


class StreamOptions(BaseModel):
    include_usage: bool = False


class _StopStrings(BaseModel):
    """`stop` as the OpenAI API and SGLang take it: one string or a list of them."""

    stop: StrictStr | list[StrictStr] | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        return check_stop(v)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class _SamplingFields(_StopStrings):
    """Sampling knobs shared by completions and chat (OpenAI plus vLLM/SGLang extras)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=-INT64_MAX, le=INT64_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # vLLM / SGLang extras
    top_k: int = Field(-1, ge=-1, le=INT32_MAX)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: bool = True

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt`: a string, a list of one string, or token ids."""

    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    max_tokens: int | None = Field(None, ge=1)
    """None (the default) means the rest of the context."""
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: StrictStr | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return v


class NativeSamplingParams(_StopStrings):
    """`sampling_params` of the SGLang-style POST /generate."""

    model_config = ConfigDict(extra="ignore")

    max_new_tokens: int | None = Field(128, ge=1)
    min_new_tokens: int = Field(0, ge=0, le=INT32_MAX)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=INT32_MAX)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = Field(None, ge=-INT64_MAX, le=INT64_MAX)


class GenerateRequest(BaseModel):
    """POST /generate: exactly one of `text` and `input_ids`."""

    model_config = ConfigDict(extra="ignore")

    text: StrictStr | None = None
    input_ids: list[StrictInt] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    rid: StrictStr | None = None


class AbortRequest(BaseModel):
    rid: StrictStr
