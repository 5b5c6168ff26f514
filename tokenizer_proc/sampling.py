"""Validation that needs the served model, and the mapping to `wire.frontend.SamplingParams`.

`protocol` checks each field alone; here the checks need what the scheduler announced in
`ServerInfo` (context length, vocabulary size) or the prompt's length. Every failure is an
`APIError` (HTTP 400, or 404 for an unknown model) with the OpenAI error body.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tokenizer_proc.errors import APIError
from tokenizer_proc.protocol import MAX_LOGPROBS, NativeLogprobs, NativeSamplingParams
from tokenizer_proc.structured import logit_bias_pairs, sglang_constraint
from trident.wire.frontend import GrammarSpec, SamplingParams, ServerInfo
from trident.wire.server_args import ServerArgs


@dataclass(frozen=True)
class ModelLimits:
    """What requests are validated against; from the scheduler's `ServerInfo` and ServerArgs."""

    served_model_name: str
    context_length: int
    vocab_size: int
    served_model_aliases: tuple[str, ...] = ()
    """The other names `model` may take (`--served-model-name` after its first)."""
    sampling_defaults: Mapping[str, int | float] = field(default_factory=dict)
    """`SamplingParams` field -> what a request that leaves it out gets, in place of the
    wire's default: the model's recommendation (`ServerArgs.sampling_defaults`)."""

    @classmethod
    def of(cls, args: ServerArgs, info: ServerInfo) -> ModelLimits:
        """The served model's, from the flags and the scheduler's ServerInfo."""
        return cls(
            args.served_model_name,
            info.context_length,
            info.vocab_size,
            args.served_model_aliases,
            args.sampling_defaults,
        )

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.served_model_aliases)

    def default_max_tokens(self, prompt_len: int, route_default: int | None) -> int | None:
        """The output budget of a request that names none: the model's `max_new_tokens` if it
        recommends one, else the route's own default (None: the rest of the context); cut to
        the context, so that a default never causes a 400."""
        budget = self.sampling_defaults.get("max_new_tokens", route_default)
        return None if budget is None else max(1, min(int(budget), self.context_length - prompt_len))


@dataclass
class SamplingRequest:
    """A request's sampling before it is resolved against the model: its knobs, and the
    fields each endpoint gives in its own way (`protocol.RESOLVED_FIELDS`)."""

    knobs: Mapping[str, Any] = field(default_factory=dict)
    """`SamplingParams` fields by name, those the client sent (`protocol._Knobs.knobs()`); one
    left out takes the model's default (`ModelLimits.sampling_defaults`), else the wire's."""
    max_tokens: int | None = None
    """None means the rest of the context (`ModelLimits.default_max_tokens` has applied the
    defaults already)."""
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: Mapping[str, float] | None = None
    """As the client sent it: {"token id": bias}."""
    grammar: GrammarSpec | None = None
    """Already parsed (tokenizer_proc/structured.py)."""
    prompt_logprobs_from: int = -1
    """The first prompt position whose logprob is returned; -1: none."""
    prompt_top_logprobs: int = 0
    bad_words_ids: list[list[int]] = field(default_factory=list)
    """vLLM's `bad_words`, tokenized (tokenization.bad_word_sequences)."""


def check_model(requested: str | None, limits: ModelLimits) -> None:
    if requested is not None and requested not in limits.served_model_names:
        names = ", ".join(f"`{n}`" for n in limits.served_model_names)
        raise APIError(
            f"The model `{requested}` does not exist; this server serves {names}.",
            404,
            param="model",
            code="model_not_found",
        )


def check_prompt_ids(ids: Sequence[int], limits: ModelLimits, param: str = "prompt") -> None:
    if not ids:
        raise APIError("The prompt is empty.", param=param, code="empty_prompt")
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise APIError(
            f"Token id {bad} is out of range: token ids must be in [0, {limits.vocab_size}).",
            param=param,
            code="invalid_token_id",
        )


def last_prompt_tokens(ids: list[int], keep: int | None, limits: ModelLimits) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens (-1: as many as the
    context holds; None: all). Returns `ids` itself when nothing is cut."""
    if keep is None:
        return ids
    if keep == -1:
        keep = limits.context_length
    if keep >= len(ids):
        return ids
    return ids[len(ids) - keep :]


def resolve_max_tokens(
    prompt_len: int, max_tokens: int | None, limits: ModelLimits, param: str, prompt_param: str = "prompt"
) -> int:
    """The output budget: the requested one if it fits, else a 400; None means the rest."""
    ctx = limits.context_length
    if prompt_len >= ctx:
        raise APIError(
            f"This model's maximum context length is {ctx} tokens, but the prompt has {prompt_len} tokens.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return ctx - prompt_len
    if max_tokens < 0:
        raise APIError(f"{param} must be at least 0, got {max_tokens}.", param=param)
    if prompt_len + max_tokens > ctx:
        raise APIError(
            f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). "
            f"Please reduce the prompt or {param}.",
            param=param,
            code="context_length_exceeded",
        )
    return max_tokens


def build_sampling_params(
    req: SamplingRequest,
    prompt_len: int,
    limits: ModelLimits,
    max_tokens_param: str = "max_tokens",
    prompt_param: str = "prompt",
) -> SamplingParams:
    """Validate against the model and map to the wire struct (max_tokens -> max_new_tokens...)."""
    max_new = resolve_max_tokens(prompt_len, req.max_tokens, limits, max_tokens_param, prompt_param)
    params = SamplingParams(
        max_new_tokens=max_new,
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs if req.logprobs else 0,
        grammar=req.grammar,
        prompt_logprobs_from=req.prompt_logprobs_from,
        prompt_top_logprobs=req.prompt_top_logprobs if req.prompt_logprobs_from >= 0 else 0,
        bad_words_ids=req.bad_words_ids,
        **{
            **{k: v for k, v in limits.sampling_defaults.items() if k != "max_new_tokens"},
            **req.knobs,
            "stop_token_ids": list(req.knobs.get("stop_token_ids") or ()),
            "allowed_token_ids": list(req.knobs.get("allowed_token_ids") or ()),
        },
    )
    if req.prompt_logprobs_from >= prompt_len:
        raise APIError(
            f"The prompt logprobs start at position {req.prompt_logprobs_from}, past the prompt's {prompt_len} tokens.",
            param="logprob_start_len",
        )
    if params.min_new_tokens > max_new:
        raise APIError(
            f"min_tokens ({params.min_new_tokens}) must not exceed max_tokens ({max_new}).", param="min_tokens"
        )
    for name in ("stop_token_ids", "allowed_token_ids"):
        bad = next((t for t in getattr(params, name) if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise APIError(f"{name} holds {bad}, outside [0, {limits.vocab_size}).", param=name)
    if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise APIError(f"top logprobs must be in [0, {MAX_LOGPROBS}].", param="logprobs")
    params.logit_bias = logit_bias_pairs(req.logit_bias, limits.vocab_size)
    return params


def native_sampling_params(
    sp: NativeSamplingParams,
    prompt_len: int,
    limits: ModelLimits,
    prompt_param: str = "text",
    logprobs: NativeLogprobs | None = None,
) -> SamplingParams:
    """SGLang-style `sampling_params` (POST /generate, the offline `Engine`) -> the wire struct,
    with /generate's logprob fields (`logprobs`) when given."""
    max_new = sp.max_new_tokens
    if "max_new_tokens" not in sp.model_fields_set:
        max_new = limits.default_max_tokens(prompt_len, max_new)
    want = logprobs is not None and logprobs.return_logprob
    sreq = SamplingRequest(
        sp.knobs(),
        max_tokens=max_new,
        logprobs=want,
        top_logprobs=logprobs.top_logprobs_num if want else 0,
        logit_bias=sp.logit_bias,
        grammar=sglang_constraint(sp.regex, sp.ebnf, sp.json_schema),
        prompt_logprobs_from=logprobs.logprob_start_len if want else -1,
        prompt_top_logprobs=logprobs.top_logprobs_num if want else 0,
    )
    return build_sampling_params(sreq, prompt_len, limits, "sampling_params.max_new_tokens", prompt_param)


def with_seed_offset(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of an n > 1 request: a distinct seed so that choices differ."""
    if params.seed is None or index == 0:
        return params
    return msgspec.structs.replace(params, seed=params.seed + index)
