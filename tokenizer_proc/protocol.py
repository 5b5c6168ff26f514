"""Request bodies of the HTTP API, as pydantic models: the shared parts, completions,
/generate, /tokenize, /detokenize, embeddings and /abort. Chat's bodies are in
`chat_protocol`, the Responses API's in `responses_protocol`, Anthropic's in
`messages_protocol`; the rules below hold for all of them.

Field-level checks (types, ranges) live here, so FastAPI reports them as validation
errors (turned into 400s by `errors`). Checks that need the served model (context length,
vocabulary size, model name) live in `sampling`, which runs after tokenization.

No field is silently dropped: every model refuses fields it does not declare (a 400
naming the field, as OpenAI answers), and the OpenAI fields that are legitimately no-ops
for one served model are declared once, in `_AcceptedNoOps`.

The sampling knobs are not declared here: `_knobs_model` takes them from the wire's
`SamplingParams` (name, type, default, range), so the API and the wire cannot disagree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, get_args, get_origin

import msgspec
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictInt,
    StrictStr,
    create_model,
    field_validator,
)

from tokenizer_proc.detokenizer import TextOptions
from trident.wire.frontend import INT32_MAX, ClientRange, SamplingParams

MAX_STOP_STRINGS = 4
MAX_N = 16
MAX_LOGPROBS = 20
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2
"""A beam search step asks for each beam's 2 x width likeliest tokens, as top logprobs."""
MAX_REQUEST_ID_CHARS = 256
MAX_CACHE_SALT_CHARS = 256
MAX_BAD_WORDS = 256
MAX_CHAT_TEMPLATE_CHARS = 256 * 1024

RESOLVED_FIELDS = frozenset(
    {
        "max_new_tokens",
        "logprobs",
        "top_logprobs",
        "logit_bias",
        "grammar",
        "prompt_logprobs_from",
        "prompt_top_logprobs",
        "bad_words_ids",
    }
)
"""`SamplingParams` fields no request takes under their own name: `sampling` resolves each
from the endpoint's own fields (max_tokens and the context left; completions' logprobs
count or chat's logprobs/top_logprobs; logit_bias's JSON map; response_format, regex,
ebnf, json_schema or a forced tool call; echo with logprobs, vLLM's prompt_logprobs or
SGLang's logprob_start_len; vLLM's bad_words, tokenized). Every other field is a knob, taken as is."""

OPENAI_NAMES = {"min_new_tokens": "min_tokens"}
"""Knobs the OpenAI routes name as vLLM does; /generate and the Engine take SGLang's names,
which are the wire's."""

KNOB_NAMES = tuple(f.name for f in msgspec.structs.fields(SamplingParams) if f.name not in RESOLVED_FIELDS)
"""The `SamplingParams` fields every request takes as the client sends them."""

_API_TYPES: dict[str, Any] = {"stop_token_ids": list[StrictInt] | None, "allowed_token_ids": list[StrictInt] | None}
"""Knobs whose JSON type differs from the wire's: token ids must be JSON integers, and
null means none."""

COMPLETION_DEFAULT_MAX_TOKENS = 16
"""A completion's budget when the request names none, as OpenAI's and vLLM's (chat has none)."""


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


def by_type(default: str) -> Discriminator:
    """Picks a union member by its `type` field (a dict's key or a model's attribute), taken
    as `default` where absent: the request APIs whose items and blocks are tagged so."""

    def tag(value: Any) -> str:
        return value.get("type", default) if isinstance(value, dict) else getattr(value, "type", default)

    return Discriminator(tag)


class _Strict(BaseModel):
    """A request body part that refuses fields it does not declare."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: with include_usage, every chunk carries the usage so far, not null."""
    include_obfuscation: bool | None = None
    """Accepted no-op: this server adds no obfuscation padding to stream chunks."""


class _AcceptedNoOps(_Strict):
    """OpenAI request fields accepted and ignored, each for a stated reason."""

    user: str | None = None
    """An end-user id for the provider's abuse monitoring; nothing to monitor here."""
    store: bool | None = None
    """Keep the completion for the provider's dashboards; nothing is stored here."""
    metadata: dict[str, str] | None = None
    """Tags for stored completions (see `store`)."""
    service_tier: str | None = None
    """The provider's processing tier; there is one tier."""
    prompt_cache_key: str | None = None
    """A routing hint for the provider's prompt cache; the radix cache needs none."""
    safety_identifier: str | None = None
    """Like `user`."""


class JsonSchemaFormat(_Strict):
    """`response_format.json_schema`, as OpenAI defines it."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """`response_format`: plain text, any JSON object, or a given JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Knobs(_Strict):
    """Base of the models that take the sampling knobs, each named as in `renamed`."""

    renamed: ClassVar[Mapping[str, str]] = {}
    """Wire name -> this API's name, where they differ."""

    def knobs(self) -> dict[str, Any]:
        """The knobs the client sent, by `SamplingParams` name. One left out, or sent as null
        (as vLLM's and OpenAI's own schemas allow), is not here: it takes the model's default
        (`--generation-config`), else the wire's."""
        sent = self.model_fields_set
        return {
            name: value
            for name in KNOB_NAMES
            if (field := self.renamed.get(name, name)) in sent and (value := getattr(self, field)) is not None
        }


def _knob_field(field: msgspec.structs.FieldInfo) -> tuple[Any, Any]:
    """(type, pydantic Field) of one knob: the wire's type (or null, which means left out),
    default and `ClientRange`."""
    wire_type, *extras = get_args(field.type) if get_origin(field.type) is Annotated else (field.type,)
    limits = next((x for x in extras if isinstance(x, ClientRange)), ClientRange())
    if field.default_factory is not msgspec.NODEFAULT:
        info = Field(default_factory=field.default_factory, ge=limits.ge, gt=limits.gt, le=limits.le)
    else:
        info = Field(field.default, ge=limits.ge, gt=limits.gt, le=limits.le)
    return _API_TYPES.get(field.name, wire_type | None), info


def _knobs_model(name: str, renamed: Mapping[str, str]) -> type[_Knobs]:
    """A request-body part declaring every knob of `SamplingParams`, under this API's names."""
    knobs = [f for f in msgspec.structs.fields(SamplingParams) if f.name in KNOB_NAMES]
    model = create_model(name, __base__=_Knobs, **{renamed.get(f.name, f.name): _knob_field(f) for f in knobs})
    model.renamed = renamed
    return model


_OpenAIKnobs = _knobs_model("_OpenAIKnobs", OPENAI_NAMES)
_NativeKnobs = _knobs_model("_NativeKnobs", {})


class _Constraints(_Strict):
    """Decoding constraints: SGLang's fields (text), also taken on the OpenAI routes."""

    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` (its decoding constraints since v0.12): exactly one of these."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    """A JSON schema, as an object or as JSON text."""
    regex: str | None = None
    choice: list[StrictStr] | None = Field(None, min_length=1)
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF grammar (xgrammar's GBNF style, with a `root` rule), as `ebnf` takes it."""
    json_object: bool | None = None
    """True: any JSON object, as `response_format: {"type": "json_object"}`."""


class _StopStrings(_Strict):
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


class _SamplingFields(_StopStrings, _AcceptedNoOps, _Constraints, _OpenAIKnobs):
    """What completions and chat share: the knobs (OpenAI's plus vLLM/SGLang's extras),
    choices, streaming."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    """vLLM's: the text keeps the stop string (or stop token) that ended it."""
    cache_salt: StrictStr | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    """vLLM's: this request shares cached prompt prefixes only with requests of the same salt
    (a secret per tenant, e.g. 43 base64 characters), so no tenant can time another's prompts."""
    priority: int = Field(0, ge=-INT32_MAX, le=INT32_MAX)
    """vLLM's: under `--schedule-policy priority`, lower is admitted first; 0 elsewhere."""
    request_id: StrictStr | None = Field(None, min_length=1, max_length=MAX_REQUEST_ID_CHARS)
    """vLLM's: names the request (else the X-Request-Id header does, else a random id): the
    response's id is `cmpl-<it>` / `chatcmpl-<it>`, and POST /abort with that id stops it."""
    return_tokens_as_token_ids: bool = False
    """vLLM's: logprobs name each token `token_id:<id>` instead of its text."""
    return_token_ids: bool = False
    """vLLM's: each choice also gives its output's `token_ids`, and the response its
    `prompt_token_ids` (a completion choice its own prompt's; streamed: the ids of each chunk,
    the prompt's in the first)."""
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """vLLM's extra field: the logprob of every prompt token, with this many top logprobs."""
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    """vLLM's: only the prompt's last k tokens are read (-1: the context length's worth)."""
    structured_outputs: StructuredOutputs | None = None
    """vLLM's decoding constraint; SGLang's `regex`/`ebnf`/`json_schema` say the same."""
    guided_json: str | dict[str, Any] | None = None
    """vLLM's names before v0.12 (clients and tutorials still send them), read as
    `structured_outputs` reads json, regex, choice and grammar (`guided_outputs`)."""
    guided_regex: str | None = None
    guided_choice: list[StrictStr] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    """Accepted no-op: every constraint is compiled by xgrammar here."""
    bad_words: list[StrictStr] | None = Field(None, max_length=MAX_BAD_WORDS)
    """vLLM's: words the output must not contain, at its start or after a space."""
    use_beam_search: bool = False
    """vLLM's: n beams, kept by summed logprob (`beam_search`); the choices are the n best."""
    spaces_between_special_tokens: bool = True
    """vLLM's, accepted with no effect: it applies to slow tokenizers, and every served
    tokenizer is a fast one, which joins special tokens without spaces (vLLM ignores it there too)."""
    length_penalty: float = 1.0
    """vLLM's, with use_beam_search: a beam ranks by summed logprob / length ** length_penalty."""

    def guided_outputs(self) -> StructuredOutputs | None:
        """The `guided_*` fields as the `structured_outputs` they stand for (None: none given)."""
        given = {
            "json": self.guided_json,
            "regex": self.guided_regex,
            "choice": self.guided_choice,
            "grammar": self.guided_grammar,
        }
        given = {name: value for name, value in given.items() if value is not None}
        return StructuredOutputs.model_validate(given) if given else None

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def usage_in_every_chunk(self) -> bool:
        return self.include_usage() and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def text_options(self) -> TextOptions:
        return TextOptions(self.stop_list(), self.include_stop_str_in_output, self.skip_special_tokens)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt`: a string, token ids, or a batch of either (a list of
    strings or of token-id lists), each prompt with its own n choices."""

    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    max_tokens: int | None = Field(None, ge=0)
    """None (the default) means COMPLETION_DEFAULT_MAX_TOKENS, or the rest of the context if
    less; 0 runs the prompt only (its logprobs with echo or prompt_logprobs: lm-eval's scoring)."""
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    """OpenAI's: each prompt runs this many candidates and answers with the n of them whose
    tokens have the highest mean logprob (at least n; not streamed when more than n). The
    usage counts every candidate's tokens."""
    suffix: StrictStr | None = None
    """OpenAI's: the text after the completion; the prompt is then the text before it, and
    the model fills in the middle through its fill-in-the-middle tokens (a model without
    them answers a 400)."""
    response_format: ResponseFormat | None = None


class NativeSamplingParams(_StopStrings, _Constraints, _NativeKnobs):
    """`sampling_params` of the SGLang-style POST /generate (and of the offline Engine)."""

    max_new_tokens: int | None = Field(128, ge=0)
    """0 runs the prompt only (for its logprobs: `return_logprob` with `logprob_start_len`)."""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    """SGLang's, accepted with no effect (see the OpenAI routes' field of that name)."""
    no_stop_trim: bool = False
    """SGLang's: the text keeps the stop string (or stop token) that ended it."""

    def text_options(self) -> TextOptions:
        return TextOptions(self.stop_list(), self.no_stop_trim, self.skip_special_tokens)


class NativeLogprobs(_Strict):
    """SGLang's logprob fields of POST /generate."""

    return_logprob: bool = False
    """meta_info gets output_token_logprobs, and input_token_logprobs from logprob_start_len on."""
    logprob_start_len: int = Field(-1, ge=-1)
    """The first prompt position with an input logprob; -1: none (SGLang's default)."""
    top_logprobs_num: int = Field(0, ge=0, le=MAX_LOGPROBS)
    return_text_in_logprobs: bool = False
    """Each logprob entry's third item is its token's text (else null)."""


class GenerateRequest(NativeLogprobs):
    """POST /generate: exactly one of `text` and `input_ids`."""

    text: StrictStr | None = None
    input_ids: list[StrictInt] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    rid: StrictStr | None = None


class TokenizeCompletionRequest(_Strict):
    """POST /tokenize of a raw prompt, as vLLM takes it."""

    model: str | None = None
    prompt: StrictStr
    add_special_tokens: bool = True
    """Add the tokenizer's own special tokens (e.g. BOS), as a completion prompt gets them."""
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    """POST /detokenize: token ids back to text."""

    model: str | None = None
    tokens: list[StrictInt]


class EmbeddingRequest(_Strict):
    """POST /v1/embeddings, as OpenAI takes it: one input (text or token ids) or a list."""

    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    """Refused (tokenizer_proc/embeddings_api.py): a vector cut short is an embedding only
    for a model trained for it (Matryoshka representation learning)."""
    user: str | None = None
    """Accepted and ignored: OpenAI's end-user id."""


class AbortRequest(_Strict):
    rid: StrictStr
