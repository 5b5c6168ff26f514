"""The Hugging Face tokenizer of the served model: loading, prompts, and token strings.

This process is the only one that holds the tokenizer: the scheduler and the workers see
token ids only. `TokenStrings` turns the (token id, logprob) pairs of `TokenOut` into the
strings and bytes of the OpenAI logprobs formats.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

from transformers import AutoTokenizer

_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SP_SPACE = "\u2581"


def load_tokenizer(model_path: str) -> Any:
    """`model_path` is a `.gguf` file (tokenizer read from its metadata) or a HF directory."""
    if model_path.endswith(".gguf"):
        directory, filename = os.path.split(os.path.abspath(model_path))
        return AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    return AutoTokenizer.from_pretrained(model_path)


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a raw completion prompt (with the tokenizer's own special tokens, e.g. BOS)."""
    return list(tokenizer.encode(text))


Decode = Callable[[Sequence[int], bool], str]
"""(token ids, skip special tokens) -> text."""


def text_decoder(tokenizer: Any) -> Decode:
    """The tokenizer's `decode`, called on its Rust backend where the Python wrapper adds nothing.

    Incremental detokenization decodes twice per request per step; the wrapper's argument
    conversion costs more than the Rust decode of a few ids. The wrapper's one extra step,
    `clean_up_tokenization_spaces`, is kept by falling back to it where it is set.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids, skip_special: tokenizer.decode(list(ids), skip_special_tokens=skip_special)
    return lambda ids, skip_special: backend.decode(ids, skip_special_tokens=skip_special)


def apply_chat_template(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> tuple[str, list[int]]:
    """The prompt text and ids of a chat, ending with the assistant turn's header; `tools`
    (OpenAI tool objects) go to templates that render them."""
    extra = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    # The template already holds every special token (BOS included): do not add them twice.
    return text, list(tokenizer.encode(text, add_special_tokens=False))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (byte-level BPE vocabularies)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=True))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


class TokenStrings:
    """Cached per-token text and raw bytes, for logprobs."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one instance per process
    def text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one instance per process
    def raw_bytes(self, token_id: int) -> list[int]:
        """The token's exact bytes (a token may hold part of a UTF-8 character)."""
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return list(self.text(token_id).encode("utf-8"))
        match = _SP_BYTE.match(piece)
        if match:
            return [int(match.group(1), 16)]
        if piece and all(c in _BYTE_DECODER for c in piece):
            return [_BYTE_DECODER[c] for c in piece]
        return list(piece.replace(_SP_SPACE, " ").encode("utf-8"))
