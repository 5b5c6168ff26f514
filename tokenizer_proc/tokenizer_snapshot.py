"""The served model's tokenizer without importing transformers: a snapshot of the tokenizer
transformers builds, taken on a model's first start and read by every later one.

Importing transformers was most of this process's start-up CPU (docs/benchmarks.md), paid
again at every start and restart, and by every server the test suite starts. What the
process needs from transformers' tokenizer is small: the Rust pipeline it assembled
(`backend_tokenizer`, its post-processor included: that is what adds BOS), the chat
template, the special tokens the template sees. A snapshot saves those three;
`SnapshotTokenizer` serves them with the `tokenizers` library and renders templates in the
sandboxed Jinja environment transformers' `apply_chat_template` builds (its options,
filters and globals, the None-valued message keys dropped, reasoning under its three
names). tests/test_tokenizer_snapshot.py holds it to transformers' output.

A tokenizer whose decode does more than the pipeline's (a WordPiece clean-up), which splits
special tokens, or keeps several named templates is marked unsupported and served by
transformers as before.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from datetime import datetime
from importlib.metadata import version
from typing import Any

SNAPSHOT_FORMAT = 1
"""Bumped when what a snapshot holds changes: older snapshots are then taken again."""

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".msgpack", ".h5", ".index.json")
_MODEL_CONFIGS = ("config.json", "generation_config.json")


def snapshot_key(tokenizer_dir: str) -> str:
    """A tokenizer's snapshot name, from what transformers builds it of: the contents of the
    directory's files (weights and model configs aside), config.json's `model_type` and
    `tokenizer_class` (which pick the tokenizer class where tokenizer_config.json names none),
    and the versions of the two libraries. By content, not path: checkpoints that carry the
    same tokenizer (a test's random-weight models) share one snapshot."""
    digest = hashlib.sha256()
    for entry in sorted(os.scandir(tokenizer_dir), key=lambda e: e.name):
        if entry.is_file() and not entry.name.endswith(_WEIGHT_SUFFIXES) and entry.name not in _MODEL_CONFIGS:
            digest.update(entry.name.encode() + b"\0")
            with open(entry.path, "rb") as f:
                digest.update(hashlib.sha256(f.read()).digest())
    try:
        with open(os.path.join(tokenizer_dir, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        config = {}
    picks = [str(config.get("model_type")), str(config.get("tokenizer_class"))]
    for part in (*picks, version("transformers"), version("tokenizers"), str(SNAPSHOT_FORMAT)):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:24]


def unsupported_reason(tokenizer: Any) -> str | None:
    """Why `tokenizer` (transformers') cannot be served from a snapshot, or None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return f"{type(tokenizer).__name__} has no tokenizers pipeline"
    if getattr(tokenizer, "split_special_tokens", False):
        return "it splits special tokens"
    if not isinstance(tokenizer.chat_template, str | None):
        return "it has several named chat templates"
    # transformers skips the WordPiece clean-up for BPE models unless forced (its _decode).
    bpe = type(backend.model).__name__ == "BPE"
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    if getattr(tokenizer, "clean_up_tokenization_spaces", False) and (forced or not bpe):
        return "its decode cleans up tokenization spaces"
    return None


def save_snapshot(tokenizer: Any, snapshot_dir: str) -> None:
    """Writes `tokenizer`'s snapshot (or the reason it has none) whole or not at all."""
    reason = unsupported_reason(tokenizer)
    meta: dict[str, Any] = {"format": SNAPSHOT_FORMAT, "unsupported": reason}
    if reason is None:
        meta |= {"chat_template": tokenizer.chat_template, "special_tokens": dict(tokenizer.special_tokens_map)}
    parent = os.path.dirname(snapshot_dir)
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(dir=parent)
    except OSError:
        return  # an unwritable cache: this start is served by transformers, and so is the next
    try:
        if reason is None:
            tokenizer.backend_tokenizer.save(os.path.join(staging, "tokenizer.json"))
        with open(os.path.join(staging, "snapshot.json"), "w") as f:
            json.dump(meta, f)
        os.replace(staging, snapshot_dir)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)  # another loader got there first, or unwritable


def load_snapshot(snapshot_dir: str) -> SnapshotTokenizer | None:
    """The snapshot in `snapshot_dir`; None when there is none or it is marked unsupported."""
    try:
        with open(os.path.join(snapshot_dir, "snapshot.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    if meta.get("format") != SNAPSHOT_FORMAT or meta.get("unsupported") is not None:
        return None
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(os.path.join(snapshot_dir, "tokenizer.json"))
    return SnapshotTokenizer(backend, meta["chat_template"], meta["special_tokens"])


class SnapshotTokenizer:
    """The part of transformers' fast tokenizer interface that trident uses, over the saved
    pipeline: the same ids, text, token strings and chat prompts."""

    clean_up_tokenization_spaces = False
    """Never set here (a tokenizer that cleans up is served by transformers): text_decoder()
    may call the pipeline's decode directly."""

    def __init__(self, backend: Any, chat_template: str | None, special_tokens: dict[str, str]) -> None:
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        """The model's Jinja template; load_tokenizer may set a known turn format's."""
        self.special_tokens_map = special_tokens
        """bos_token, eos_token, ... as strings: the variables a template sees beside the chat."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def get_added_vocab(self) -> dict[str, int]:
        decoder = self.backend_tokenizer.get_added_tokens_decoder()
        return {token.content: i for i, token in sorted(decoder.items())}

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        chat_template: str | None = None,
        documents: list[dict[str, str]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The chat rendered as text, as transformers renders it (`tokenize=False` only);
        `chat_template` replaces the tokenizer's."""
        if tokenize:
            raise ValueError("SnapshotTokenizer renders text only: encode the result")
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template")
        messages = [{k: v for k, v in m.items() if v is not None} for m in conversation]
        variables = {**self.special_tokens_map, **kwargs}
        return _compiled(template).render(
            messages=_with_reasoning_aliases(messages),
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )


COMPILED_TEMPLATES = 64
"""Chat templates kept compiled: the model's, and the latest requests' own (a request may
bring one under --trust-request-chat-template)."""

_REASONING_NAMES = ("reasoning_content", "thinking", "reasoning")
"""A message's reasoning, under the names templates read: transformers fills
`reasoning_content` and `thinking` from whichever is set first in this order."""


def _with_reasoning_aliases(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        reasoning = next((message[k] for k in _REASONING_NAMES if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


@functools.lru_cache(maxsize=COMPILED_TEMPLATES)
def _compiled(template: str) -> Any:
    return _environment().from_string(template)


def _environment() -> Any:
    """A sandboxed Jinja environment with the options, filters and globals of transformers'
    (chat templates are untrusted code from the model's files)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlocks(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
        here it renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class TemplateNamespace(jinja2.utils.Namespace):
        """`namespace()` without underscore-prefixed attributes (a way out of the sandbox)."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")

    class TemplateDict:
        """`dict(...)` and `dict.fromkeys(...)`, without the type itself in reach."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlocks, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env
