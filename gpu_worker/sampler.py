"""Sampling on the worker, vectorised over the rows that sample this step.

Per-row parameters live in `SamplingTable`, indexed by slot: written when a request
joins, read each step. Penalties use per-slot token counts that the table keeps
current. A row with a seed draws from its own generator, so its tokens do not depend on
what else shares the batch. A row under a grammar has its matcher in the table's
`GrammarTable` (grammar.py): its mask is applied last, after penalties and `logit_bias`,
and the matcher advances on the token the row sampled.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gpu_worker.grammar import GrammarTable
from trident.wire.backend import RowLogprobs
from trident.wire.frontend import SamplingParams

NEG_INF = float("-inf")


class SamplingTable:
    """Per-slot sampling state: parameters, generated-token counts, seeded generators."""

    def __init__(self, max_slots: int, vocab_size: int, eos_token_ids: list[int], device: torch.device) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.params: list[SamplingParams | None] = [None] * max_slots
        self.generated = [0] * max_slots
        self.generators: list[torch.Generator | None] = [None] * max_slots
        # Allocated on first use: most workloads never set a penalty.
        self.output_counts: torch.Tensor | None = None
        self.prompt_seen: torch.Tensor | None = None
        self._max_slots = max_slots
        self.bf16_argmax: Callable[[torch.Tensor], torch.Tensor] | None = None
        """The C++ greedy argmax for bf16 logits on CPU (cpu_kernels.py), set by the worker."""
        self.grammars: GrammarTable | None = None
        """Matchers of constrained rows; set by a worker that serves a real vocabulary."""

    def add(self, slot: int, params: SamplingParams, generated_ids: list[int]) -> None:
        self.params[slot] = params
        if self.grammars is not None:
            self.grammars.add(slot, params.grammar, generated_ids)
        self.generated[slot] = len(generated_ids)
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
        self.generators[slot] = gen
        if _uses_penalties(params):
            self._ensure_penalty_tables()
            self.output_counts[slot].zero_()
            self.prompt_seen[slot].zero_()
            if generated_ids:
                ids = torch.tensor(generated_ids, device=self.device)
                self.output_counts[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def remove(self, slot: int) -> None:
        self.params[slot] = None
        self.generators[slot] = None
        if self.grammars is not None:
            self.grammars.remove(slot)

    def note_prompt_tokens(self, slot: int, token_ids: torch.Tensor) -> None:
        if self.prompt_seen is not None and _uses_penalties(self.params[slot]):
            self.prompt_seen[slot, token_ids] = True

    def note_sampled(self, slots: list[int], tokens: torch.Tensor) -> None:
        for s in slots:
            self.generated[s] += 1
        if self.grammars is not None and self.grammars.constrained(slots):
            for s, t in zip(slots, tokens.tolist()):
                self.grammars.advance(s, t)
        if self.output_counts is not None:
            idx = torch.tensor(slots, device=self.device)
            ones = torch.ones(len(slots), dtype=torch.int32, device=self.device)
            self.output_counts.index_put_((idx, tokens), ones, accumulate=True)

    def _ensure_penalty_tables(self) -> None:
        if self.output_counts is None:
            shape = (self._max_slots, self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_seen = torch.zeros(shape, dtype=torch.bool, device=self.device)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's greedy token (the first index of its largest logit, or of a NaN)."""
        if self.bf16_argmax is not None and logits.dtype == torch.bfloat16 and logits.device.type == "cpu":
            return self.bf16_argmax(logits)
        return greedy_tokens(logits)


def _uses_penalties(p: SamplingParams | None) -> bool:
    return p is not None and (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 or p.repetition_penalty != 1.0)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row, first index on ties (as argmax). `max(dim).indices` rather
    than `argmax`: on CPU in bfloat16, argmax's kernel is ~2x slower (2.99 vs 1.33 ms for
    32 x 49,152 logits on this machine's Zen 4 cores)."""
    return logits.max(dim=-1).indices


def sample(
    logits: torch.Tensor,
    slots: list[int],
    table: SamplingTable,
    agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, list[RowLogprobs | None]]:
    """logits [rows, vocab] in the model's dtype -> (token ids [rows] int64, per-row logprobs or []).

    A batch of plain greedy rows takes the argmax of the logits as they are (converting
    them cannot change which is largest); anything else works on float32 logits.
    `agree` makes the tensor-parallel ranks take one set of tokens (rank 0's) before any
    per-row state (penalty counts, logprobs, grammar matchers) is updated from them."""
    params = [table.params[s] for s in slots]
    all_greedy = all(p.temperature <= 0.0 for p in params)
    if not all_greedy or any(p.logprobs or p.logit_bias or p.grammar or _uses_penalties(p) for p in params):
        logits = logits.float()
    raw_logprobs = None
    if any(p.logprobs for p in params):
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    logits = _apply_penalties(logits, slots, params, table)
    logits = _apply_logit_bias(logits, params)
    logits = _mask_eos_before_min_tokens(logits, slots, params, table)
    constrained = table.grammars.constrained(slots) if table.grammars is not None else []
    if constrained:
        logits = table.grammars.apply_masks(logits, slots, constrained)

    tokens = table.argmax(logits)
    if not all_greedy:
        greedy = torch.tensor([p.temperature <= 0.0 for p in params], device=logits.device)
        temps = torch.tensor([max(p.temperature, 1e-6) for p in params], device=logits.device)
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        probs = _filter_top_k_top_p_min_p(probs, params)
        sampled = _draw(probs, slots, table)
        tokens = torch.where(greedy, tokens, sampled)
    if agree is not None:
        tokens = agree(tokens)
    table.note_sampled(slots, tokens)
    return tokens, _gather_logprobs(raw_logprobs, tokens, params)


def _apply_penalties(logits, slots, params, table: SamplingTable) -> torch.Tensor:
    if table.output_counts is None or not any(_uses_penalties(p) for p in params):
        return logits
    idx = torch.tensor(slots, device=logits.device)
    counts = table.output_counts[idx].float()
    freq = torch.tensor([p.frequency_penalty for p in params], device=logits.device)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], device=logits.device)[:, None]
    rep = torch.tensor([p.repetition_penalty for p in params], device=logits.device)[:, None]
    seen = (counts > 0) | table.prompt_seen[idx]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    return logits - freq * counts - pres * (counts > 0).float()


def _apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """OpenAI's logit_bias: each (token, bias) pair added to that row's logit."""
    pairs = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
    if not pairs:
        return logits
    rows, tokens, biases = zip(*pairs)
    logits = logits.clone()
    dev = logits.device
    logits.index_put_(
        (torch.tensor(rows, device=dev), torch.tensor(tokens, device=dev)),
        torch.tensor(biases, dtype=logits.dtype, device=dev),
        accumulate=True,
    )
    return logits


def _mask_eos_before_min_tokens(logits, slots, params, table: SamplingTable) -> torch.Tensor:
    rows = [i for i, (s, p) in enumerate(zip(slots, params)) if table.generated[s] < p.min_new_tokens]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        stop_ids = list(params[i].stop_token_ids) + ([] if params[i].ignore_eos else table.eos_token_ids)
        if stop_ids:
            logits[i, stop_ids] = NEG_INF
    return logits


def _filter_top_k_top_p_min_p(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    if all(p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0 for p in params):
        return probs
    dev = probs.device
    vocab = probs.shape[-1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    min_p = torch.tensor([p.min_p for p in params], device=dev)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=dev)[None, :]
    cum_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = (rank < top_k[:, None]) & (cum_before < top_p[:, None])
    keep &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
    keep[:, 0] = True  # the most likely token always survives
    sorted_probs = sorted_probs * keep
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def _draw(probs: torch.Tensor, slots: list[int], table: SamplingTable) -> torch.Tensor:
    """Exponential-race sampling: argmax(p / E), E ~ Exp(1), per-row generator if seeded."""
    noise = torch.empty_like(probs)
    for i, s in enumerate(slots):
        noise[i].exponential_(generator=table.generators[s])
    return (probs / noise).argmax(dim=-1)


def _gather_logprobs(raw: torch.Tensor | None, tokens: torch.Tensor, params) -> list[RowLogprobs | None]:
    if raw is None:
        return []
    k = max(p.top_logprobs for p in params)
    top_vals, top_ids = raw.topk(k, dim=-1) if k > 0 else (None, None)
    chosen = raw.gather(-1, tokens[:, None]).squeeze(-1).tolist()
    out: list[RowLogprobs | None] = []
    for i, p in enumerate(params):
        if not p.logprobs:
            out.append(None)
            continue
        n = p.top_logprobs
        top = list(zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist())) if n else []
        out.append(RowLogprobs(chosen[i], top))
    return out
