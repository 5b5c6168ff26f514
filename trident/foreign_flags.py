"""Other engines' flags that are not ours: a vLLM or SGLang command line should start
trident, or say plainly which of our flags to use instead.

Some ask for what trident always does, or for something that has no meaning here: they are
accepted and logged as having no effect. Others name a setting trident takes differently:
they are refused, and the error names ours. vLLM's `--speculative-config` is translated into
our speculative flags. Spellings of flags we do have (`--max-model-len`,
`-tp`, ...) are not here: they are names of those flags (trident/wire/server_args.py).
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass

logger = logging.getLogger("trident.launch")


@dataclass(frozen=True)
class ForeignFlag:
    name: str
    engines: str
    """Whose flag it is, for the docs: "vLLM", "SGLang", "vLLM, SGLang"."""
    accepted: bool
    """True: a switch, parsed and ignored; False: a flag with a value, refused."""
    why: str
    """Accepted: why it changes nothing here. Refused: what to use instead."""

    @property
    def dest(self) -> str:
        """Where argparse keeps it: apart from every ServerArgs field."""
        return "foreign_" + self.name.lstrip("-").replace("-", "_")


_KV_POOL_FLAGS = "size the KV pool with --mem-fraction (a fraction of the free memory) or --max-total-tokens"

FOREIGN_FLAGS = (
    ForeignFlag(
        "--trust-remote-code", "vLLM, SGLang", True, "no code from a checkpoint runs: every family is built in"
    ),
    ForeignFlag("--enable-auto-tool-choice", "vLLM", True, "tool calls are parsed whenever a request has tools"),
    ForeignFlag(
        "--disable-log-requests", "vLLM, SGLang", True, "requests are not logged (an access line at --log-level debug)"
    ),
    ForeignFlag("--enable-chunked-prefill", "vLLM", True, "prompts are always chunked, by --chunked-prefill-size"),
    ForeignFlag(
        "--enable-prompt-tokens-details",
        "vLLM",
        True,
        "usage always carries prompt_tokens_details.cached_tokens",
    ),
    ForeignFlag("--enable-server-load-tracking", "vLLM", True, "GET /load is always served"),
    ForeignFlag("--disable-fastapi-docs", "vLLM", True, "no docs pages are served"),
    ForeignFlag("--gpu-memory-utilization", "vLLM", False, _KV_POOL_FLAGS),
    ForeignFlag("--mem-fraction-static", "SGLang", False, _KV_POOL_FLAGS),
    ForeignFlag(
        "--max-num-batched-tokens",
        "vLLM",
        False,
        "bound a step's prompt tokens with --max-prefill-tokens, and one request's with --chunked-prefill-size",
    ),
    ForeignFlag("--quantization", "vLLM, SGLang", False, "serve a GGUF's own formats (--weight-dtype gguf) or int8"),
    ForeignFlag("--kv-cache-dtype", "vLLM, SGLang", False, "the KV cache takes --dtype"),
)


SPECULATIVE_CONFIG_KEYS = {
    "method": "--speculative-algorithm",
    "num_speculative_tokens": "--speculative-num-draft-tokens",
    "prompt_lookup_min": "--speculative-ngram-min",
    "prompt_lookup_max": "--speculative-ngram-max",
}
"""vLLM's `--speculative-config` keys -> the flags they set here."""


class _SpeculativeConfig(argparse.Action):
    """vLLM's `--speculative-config '{"method": "ngram", ...}'`, set as our flags say it."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        try:
            config = json.loads(values)
        except ValueError as e:
            parser.error(f"--speculative-config is not JSON: {e}")
        if not isinstance(config, dict):
            parser.error("--speculative-config must be a JSON object")
        unknown = sorted(set(config) - set(SPECULATIVE_CONFIG_KEYS))
        if unknown:
            parser.error(
                f"--speculative-config: {', '.join(unknown)} has no counterpart here "
                f"(it takes {', '.join(SPECULATIVE_CONFIG_KEYS)})"
            )
        if config.get("method") != "ngram":
            parser.error("--speculative-config: method ngram (prompt lookup) is the one served; draft models are not")
        namespace.speculative_algorithm = "ngram"
        for key, dest in (
            ("num_speculative_tokens", "speculative_num_draft_tokens"),
            ("prompt_lookup_min", "speculative_ngram_min"),
            ("prompt_lookup_max", "speculative_ngram_max"),
        ):
            if key in config:
                if isinstance(config[key], bool) or not isinstance(config[key], int):
                    parser.error(f"--speculative-config: {key} must be a whole number, not {config[key]!r}")
                setattr(namespace, dest, config[key])


class _Refused(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        flag = next(f for f in FOREIGN_FLAGS if f.name == option_string)
        parser.error(f"{flag.name} is {flag.engines}'s flag, not trident's: {flag.why}")


def add_foreign_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("other engines' flags", "accepted with no effect, or refused naming ours")
    group.add_argument(
        "--speculative-config",
        dest="foreign_speculative_config",
        action=_SpeculativeConfig,
        metavar="JSON",
        help="vLLM's: sets the --speculative-* flags, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'',
    )
    for flag in FOREIGN_FLAGS:
        help_text = f"{flag.engines}'s: " + (f"no effect ({flag.why})" if flag.accepted else f"refused: {flag.why}")
        if flag.accepted:
            group.add_argument(flag.name, dest=flag.dest, action="store_true", help=help_text)
        else:
            group.add_argument(flag.name, dest=flag.dest, action=_Refused, metavar="VALUE", help=help_text)


def log_foreign_flags(ns: argparse.Namespace) -> None:
    """One line for each accepted foreign flag the command line gave, saying why it does nothing."""
    for flag in FOREIGN_FLAGS:
        if flag.accepted and getattr(ns, flag.dest, None):
            logger.info("%s (%s's flag) has no effect: %s", flag.name, flag.engines, flag.why)


def foreign_flags_doc() -> list[str]:
    """docs/flags.md's section on them."""
    lines = [
        "## Other engines' flags",
        "",
        "A vLLM or SGLang command line starts trident, or says which of our flags to use instead.",
        "",
        "| flag | engines | here |",
        "|---|---|---|",
    ]
    ours = ", ".join(f"{key}: `{flag}`" for key, flag in SPECULATIVE_CONFIG_KEYS.items())
    lines.append(f"| `--speculative-config` JSON | vLLM | translated: {ours} (method ngram only) |")
    for flag in FOREIGN_FLAGS:
        lines.append(f"| `{flag.name}` | {flag.engines} | {'no effect' if flag.accepted else 'refused'}: {flag.why} |")
    return [*lines, ""]
