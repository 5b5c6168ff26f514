"""A request's sampling defaults, resolved once at launch as vLLM's `--generation-config` does.

A model's makers ship the sampling they recommend (Qwen3: temperature 0.6, top_p 0.95,
top_k 20) in generation_config.json, or in a GGUF's general.sampling.* metadata. vLLM makes
these the defaults of every request that leaves a field out, and a user moving from vLLM
expects the same text distribution here. `--generation-config vllm` turns that off;
`--override-generation-config` lays the user's own values over either.

The result, `ServerArgs.sampling_defaults`, reaches every process in the args file; the
tokenizer process applies it (tokenizer_proc/sampling.py).
"""

from __future__ import annotations

import logging
import os
from typing import Annotated, Any, get_args, get_origin

import msgspec

from trident.wire.frontend import ClientRange, SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
"""The generation_config.json fields that are a request's sampling defaults (vLLM reads the
same ones); each is also the `SamplingParams` field it sets."""

NEUTRAL = "vllm"
"""`--generation-config vllm`: vLLM's name for its own neutral defaults, kept so that vLLM
command lines work unchanged."""


class GenerationConfigError(ValueError):
    """A `--generation-config` or `--override-generation-config` that cannot be used."""


def resolve_sampling_defaults(choice: str, override: dict[str, Any] | None, model_path: str) -> dict[str, int | float]:
    """`SamplingParams` field -> default, from the flags and the model at `model_path`.

    The model's own values (`auto`) that a request could not send are left out with a
    warning: a model must stay servable whatever its file recommends. Values the user gave
    (a DIR, the override) are checked strictly: GenerationConfigError names the one at fault."""
    # Imported here, as model_source.py does: the check's readers cost a third of a second,
    # which `--help` and the other commands need not pay.
    from gpu_worker.model.model_check import UnservableModel, generation_config_file, recommended_sampling

    try:
        if choice == "auto":
            found, source, strict = recommended_sampling(model_path), "the model", False
        elif choice == NEUTRAL:
            found, source, strict = {}, "", True
        else:
            config = os.path.join(os.path.expanduser(choice), "generation_config.json")
            found, source, strict = generation_config_file(config, required=True), config, True
    except UnservableModel as e:
        raise GenerationConfigError(f"--generation-config: {e}") from None
    taken = {key: found[key] for key in GENERATION_CONFIG_KEYS if found.get(key) is not None}
    defaults = checked(taken, source, strict)
    if override:
        defaults |= checked(known_keys(override), "--override-generation-config", strict=True)
    if defaults:
        # vLLM says so too: a user who expected neutral sampling learns why the text differs.
        logger.info(
            "requests that leave them out get %s (from %s%s; --generation-config vllm for the engine's own)",
            describe(defaults),
            source or "the engine",
            " and --override-generation-config" if override else "",
        )
    return defaults


def known_keys(value: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(value) - set(GENERATION_CONFIG_KEYS))
    if unknown:
        raise GenerationConfigError(
            f"--override-generation-config: {', '.join(unknown)} cannot be defaulted; "
            f"the keys are {', '.join(GENERATION_CONFIG_KEYS)}"
        )
    return value


def checked(values: dict[str, Any], source: str, strict: bool) -> dict[str, int | float]:
    """`values` whose type and range a client could send; an outsider is an error when
    `strict`, else left out and logged."""
    out: dict[str, int | float] = {}
    for key, value in values.items():
        problem = _problem(key, value)
        if problem is None:
            out[key] = int(value) if key in _INTEGER_KEYS else float(value)
        elif strict:
            raise GenerationConfigError(f"{source}: {key} {value!r} {problem}")
        else:
            logger.warning("%s recommends %s %r, which %s: left at the engine's default", source, key, value, problem)
    return out


_INTEGER_KEYS = ("top_k", "max_new_tokens")


def _problem(key: str, value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "is not a number"
    if key in _INTEGER_KEYS and value != int(value):
        return "is not a whole number"
    if key == "max_new_tokens":
        return None if value >= 1 else "is below 1"
    limits = _RANGES[key]
    low_ok = (limits.ge is None or value >= limits.ge) and (limits.gt is None or value > limits.gt)
    if low_ok and (limits.le is None or value <= limits.le):
        return None
    low = f"[{limits.ge}" if limits.ge is not None else f"({limits.gt}"
    return f"is outside {low}, {limits.le}]"


def _client_ranges() -> dict[str, ClientRange]:
    ranges = {}
    for field in msgspec.structs.fields(SamplingParams):
        if field.name in GENERATION_CONFIG_KEYS and get_origin(field.type) is Annotated:
            ranges[field.name] = next(x for x in get_args(field.type)[1:] if isinstance(x, ClientRange))
    return ranges


_RANGES = _client_ranges()
"""The range a client may send each knob: a default outside it would be a request the
tokenizer refuses."""


def describe(defaults: dict[str, int | float]) -> str:
    """For the log: `temperature 0.6, top_p 0.95` or `none`."""
    return ", ".join(f"{k} {v:g}" for k, v in defaults.items()) or "none"
