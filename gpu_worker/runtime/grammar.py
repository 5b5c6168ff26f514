"""Constrained decoding on the worker: one grammar matcher per constrained row (xgrammar).

Who owns the matcher state, and why here: a row's vocabulary mask must be known before
the row samples, and with overlap on the scheduler builds step N+1 before it has seen step
N's tokens. The worker is the one process that holds every sampled token at the moment it
is sampled, so the matcher lives here, next to the sampling table: it advances on the
row's token right after sampling (`advance`), and the next step's mask is filled from it
after that step's forward (`apply_masks`), with no round trip to another process and no
change to what the scheduler sends. The scheduler and the tokenizer only carry the
grammar's text (`wire.frontend.GrammarSpec`) with the request. Every tensor-parallel rank
keeps its own matchers and advances them on the tokens the ranks agreed on, so they stay
identical.

Restarts and retractions: a request that comes back (`AddedRequest.generated_ids`) gets a
fresh matcher that re-advances over the tokens it already produced, so its output stays
valid across a worker or scheduler restart.

Speculative decoding: constrained rows do not draft (`SamplingParams.drafts_allowed`).

Filling one row's mask costs microseconds (docs/benchmarks.md, "Structured outputs"), less
than handing it to a thread, so masks are filled in line between the forward and sampling.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import torch

from trident.wire.frontend import GrammarSpec
from trident.wire.tokenizer_files import gguf_tokenizer_dir

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

COMPILED_CACHE_SIZE = 256
"""Distinct grammars kept compiled; a client reusing its schema compiles it once."""


def load_vocabulary(tokenizer_path: str, vocab_size: int, eos_token_ids: list[int]) -> xgrammar.TokenizerInfo:
    """The served model's token strings, as the grammar compiler needs them.

    The tokenizer process holds the tokenizer; the worker reads it here only once a
    constrained request arrives, so unconstrained serving starts no slower. A GGUF's comes
    from the files the tokenizer process converted it to at its start, not from the GGUF
    again (seconds, per worker)."""
    import xgrammar
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        gguf_tokenizer_dir(tokenizer_path) if tokenizer_path.endswith(".gguf") else tokenizer_path
    )
    return xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids)


class GrammarTable:
    """Per-slot matchers of the constrained rows, and the compiled-grammar cache."""

    def __init__(self, max_slots: int, vocab_size: int, tokenizer_path: str, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._tokenizer_path = tokenizer_path
        """`ServerArgs.tokenizer_source`: the model's, or `--tokenizer`."""
        self._compiler: xgrammar.GrammarCompiler | None = None
        self.matchers: list[xgrammar.GrammarMatcher | None] = [None] * max_slots
        self.stop_only: set[int] = set()
        """Slots whose grammar failed to compile on this worker: they may only stop."""
        self._max_slots = max_slots
        self._bitmask: torch.Tensor | None = None
        """Allocated with the compiler: xgrammar is imported only once a grammar arrives."""
        self._compile = lru_cache(maxsize=COMPILED_CACHE_SIZE)(self._compile_uncached)

    def _compile_uncached(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        import xgrammar

        if self._compiler is None:
            self._bitmask = xgrammar.allocate_token_bitmask(self._max_slots, self.vocab_size)
            info = load_vocabulary(self._tokenizer_path, self.vocab_size, self.eos_token_ids)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        if spec.kind == "json_schema":
            return self._compiler.compile_json_schema(spec.text, any_whitespace=False, strict_mode=spec.strict)
        if spec.kind == "regex":
            return self._compiler.compile_regex(spec.text)
        if spec.kind == "ebnf":
            return self._compiler.compile_grammar(spec.text)
        raise ValueError(f"unknown grammar kind {spec.kind!r}")

    def add(self, slot: int, spec: GrammarSpec | None, generated_ids: list[int]) -> None:
        """A row joins: a fresh matcher, advanced over what the request already produced."""
        self.remove(slot)
        if spec is None:
            return
        import xgrammar

        try:
            self.matchers[slot] = xgrammar.GrammarMatcher(self._compile(spec))
        except (RuntimeError, ValueError) as e:
            # The tokenizer parsed it, so this is a library fault: the row ends at once
            # rather than running unconstrained.
            logger.error("slot %d: grammar %s failed to compile: %s", slot, spec.kind, e)
            self.stop_only.add(slot)
        for token in generated_ids:
            self.advance(slot, token)

    def remove(self, slot: int) -> None:
        self.matchers[slot] = None
        self.stop_only.discard(slot)

    def constrained(self, slots: list[int]) -> list[int]:
        """Indices into `slots` of the rows under a grammar."""
        return [i for i, s in enumerate(slots) if self.matchers[s] is not None or s in self.stop_only]

    def advance(self, slot: int, token: int) -> None:
        matcher = self.matchers[slot]
        if matcher is None or matcher.is_terminated():
            return
        if not matcher.accept_token(token):
            logger.warning("slot %d: sampled token %d outside its grammar", slot, token)

    def apply_masks(self, logits: torch.Tensor, slots: list[int], rows: list[int]) -> torch.Tensor:
        """`logits` with -inf wherever the grammar of row i (for i in `rows`) forbids a token.
        Out of place (the model's logits are inference tensors). A row whose grammar allows
        every token here (xgrammar says so while it fills the mask) is left as it is."""
        masked: list[int] = []
        bitmask = self._bitmask
        assert bitmask is not None, "a constrained row exists only after a compile allocated the mask"
        for i in rows:
            j = len(masked)
            matcher = self.matchers[slots[i]]
            if matcher is None or matcher.is_terminated():
                bitmask[j].zero_()
                _set_bits(bitmask[j], self.eos_token_ids)
            elif not matcher.fill_next_token_bitmask(bitmask, j):
                continue
            masked.append(i)
        if not masked:
            return logits
        forbidden = ~_unpack(bitmask[: len(masked)].numpy(), logits.shape[-1])
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            # numpy, one thread: torch's masking ops go parallel on a row this wide, and on
            # a shared host their thread sync costs far more than the masking itself
            # (docs/benchmarks.md, "Structured outputs").
            out = logits.numpy().copy()
            for j, i in enumerate(masked):
                np.copyto(out[i], -np.inf, where=forbidden[j])
            return torch.from_numpy(out)
        mask = torch.from_numpy(forbidden).to(logits.device)
        index = torch.tensor(masked, device=logits.device)
        return logits.index_put((index,), torch.where(mask, float("-inf"), logits[index]))


def _unpack(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """int32 bitmask [rows, ceil(vocab/32)] (bit j of word w: token 32w + j) -> bool [rows, vocab]."""
    return np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little")[:, :vocab].view(np.bool_)


def _set_bits(row: torch.Tensor, token_ids: list[int]) -> None:
    words = row.numpy().view(np.uint32)
    for t in token_ids:
        words[t // 32] |= np.uint32(1 << (t % 32))
