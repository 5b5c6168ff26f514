"""Sampling on the worker, vectorised over the rows that sample this step.

Per-row parameters live in `SamplingTable`, indexed by slot: written when a request
joins, read each step and sent to the device as one staged array (`RowParams`), so no
step launches a kernel per row. Penalties use per-slot token counts that the table keeps
current. A row with a seed draws its noise from a hash of (seed, tokens generated, token
id), so its tokens do not depend on what else shares the batch. A row under a grammar
has its matcher in the table's `GrammarTable` (grammar.py): its mask is applied last,
after penalties, `logit_bias`, allowed tokens and banned ones, and the matcher advances on
the token the row sampled. A row with bad words keeps its last few tokens here, on the
host (`recent_ids`), to find the words' last tokens to ban.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import numpy as np
import torch

from gpu_worker.runtime.grammar import GrammarTable
from gpu_worker.runtime.host_staging import StepStaging
from trident.wire.backend import RowLogprobs
from trident.wire.frontend import SamplingParams

NEG_INF = float("-inf")


class SamplingTable:
    """Per-slot sampling state: parameters, generated-token counts, penalty tables, grammars."""

    def __init__(self, max_slots: int, vocab_size: int, eos_token_ids: list[int], device: torch.device) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.params: list[SamplingParams | None] = [None] * max_slots
        self.generated = [0] * max_slots
        self.staging = StepStaging(device)
        """Each step's per-row parameters on their way to the device (RowParams)."""
        # Allocated on first use: most workloads never set a penalty.
        self.output_counts: torch.Tensor | None = None
        self.prompt_seen: torch.Tensor | None = None
        self._max_slots = max_slots
        self._token_hashes: torch.Tensor | None = None
        self.bf16_argmax: Callable[[torch.Tensor], torch.Tensor] | None = None
        """The C++ greedy argmax for bf16 logits on CPU (cpu_kernels.py), set by the worker."""
        self.grammars: GrammarTable | None = None
        """Matchers of constrained rows; set by a worker that serves a real vocabulary."""
        self.recent_ids: dict[int, list[int]] = {}
        """Rows with bad words: their last generated tokens, as many as the longest word less one."""

    def add(self, slot: int, params: SamplingParams, generated_ids: list[int]) -> None:
        self.params[slot] = params
        if self.grammars is not None:
            self.grammars.add(slot, params.grammar, generated_ids)
        self.generated[slot] = len(generated_ids)
        self.recent_ids.pop(slot, None)
        if params.bad_words_ids:
            self.recent_ids[slot] = generated_ids[len(generated_ids) - _history_needed(params) :]
        if _uses_penalties(params):
            self._ensure_penalty_tables()
            self.output_counts[slot].zero_()
            self.prompt_seen[slot].zero_()
            if generated_ids:
                ids = torch.tensor(generated_ids, device=self.device)
                self.output_counts[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def remove(self, slot: int) -> None:
        self.params[slot] = None
        self.recent_ids.pop(slot, None)
        if self.grammars is not None:
            self.grammars.remove(slot)

    def note_prompt_tokens(self, slot: int, token_ids: np.ndarray) -> None:
        """A prompt chunk of `slot`; only a row with penalties sends it to the device."""
        if self.prompt_seen is not None and _uses_penalties(self.params[slot]):
            self.prompt_seen[slot, torch.from_numpy(token_ids.astype(np.int64)).to(self.device)] = True

    def note_sampled(self, slots: list[int], tokens: torch.Tensor, slots_dev: torch.Tensor | None) -> None:
        """`slots_dev`: `slots` on the device (RowParams.slots), given whenever penalty
        tables exist."""
        for s in slots:
            self.generated[s] += 1
        constrained = self.grammars is not None and self.grammars.constrained(slots)
        if constrained or (self.recent_ids and any(s in self.recent_ids for s in slots)):
            for s, t in zip(slots, tokens.tolist()):  # one copy to the host for both
                if constrained:
                    self.grammars.advance(s, t)
                if s in self.recent_ids:
                    recent = self.recent_ids[s]
                    recent.append(t)
                    del recent[: len(recent) - _history_needed(self.params[s])]
        if self.output_counts is not None:
            assert slots_dev is not None
            ones = torch.ones(len(slots), dtype=torch.int32, device=self.device)
            self.output_counts.index_put_((slots_dev, tokens), ones, accumulate=True)

    def token_hashes(self) -> torch.Tensor:
        if self._token_hashes is None:
            self._token_hashes = hash_token_ids(self.vocab_size, self.device)
        return self._token_hashes

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


def _history_needed(p: SamplingParams | None) -> int:
    """Generated tokens a row with bad words keeps: its longest word's length less one."""
    return max((len(w) for w in p.bad_words_ids), default=1) - 1 if p is not None else 0


def banned_tokens(p: SamplingParams, recent: list[int]) -> list[int]:
    """The last token of each of the row's bad words whose other tokens end its output so far
    (a one-token word always)."""
    return [w[-1] for w in p.bad_words_ids if len(w) == 1 or recent[len(recent) - len(w) + 1 :] == w[:-1]]


def _uses_penalties(p: SamplingParams | None) -> bool:
    return p is not None and (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 or p.repetition_penalty != 1.0)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row, first index on ties (as argmax). `max(dim).indices` rather
    than `argmax`: on CPU in bfloat16, torch's argmax kernel is the slower of the two
    (docs/benchmarks.md, "Kernels")."""
    return logits.max(dim=-1).indices


_MASK32 = 0xFFFFFFFF


def _mix32(x):
    """A 32-bit integer hash (lowbias32, from Wellons' hash-prospector) of values held in
    int64, on Python ints or tensors alike. A product may wrap past int64 on a tensor; its
    low 32 bits, all that is kept, are right either way."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def row_key(seed: int, generated: int) -> int:
    """The 32-bit key of a seeded row's draw after `generated` tokens: its noise depends on
    nothing else in the batch, and a request resumed with its tokens draws as it would have."""
    seed &= (1 << 64) - 1
    return _mix32((seed & _MASK32) ^ _mix32((seed >> 32) ^ _mix32(generated & _MASK32)))


def hash_token_ids(vocab_size: int, device: torch.device) -> torch.Tensor:
    """Each token id's hash, the per-token half of a seeded draw (computed once per table)."""
    return _mix32(torch.arange(vocab_size, dtype=torch.int64, device=device) + 0x9E3779B9)


def seeded_exponentials(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise [rows, vocab] from each row's key and `hash_token_ids`, in one set of ops
    for all rows."""
    # 23 bits, so that bits + 0.5 is exact in float32 and the uniform stays below 1: with
    # 24, the top value rounded up to 1.0, and a noise of 0 made a forbidden token's 0 / 0
    # (grammar, top-k) a NaN that argmax picks.
    bits = _mix32(keys[:, None] ^ tokens[None, :]) >> 9
    return -torch.log((bits.float() + 0.5) * (1.0 / (1 << 23)))


PARAM_COLUMNS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
"""The `SamplingParams` fields staged per row, each read by its name: one float32 column each."""
_read_columns = operator.attrgetter(*PARAM_COLUMNS)
_TOP_K = PARAM_COLUMNS.index("top_k")


class RowParams:
    """One step's per-row sampling parameters on the device, sent in one staged copy per
    dtype: no tensor per parameter, no kernel per row."""

    def __init__(self, params: list[SamplingParams], slots: list[int], table: SamplingTable) -> None:
        stage, vocab = table.staging.stage, table.vocab_size
        table.staging.begin_step()
        self.slots = stage(slots, torch.int64)
        values = [list(_read_columns(p)) for p in params]
        for row in values:
            if row[_TOP_K] <= 0:  # the whole vocabulary
                row[_TOP_K] = vocab
        self.values = stage(values, torch.float32, (len(params), len(PARAM_COLUMNS)))
        bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
        self.bias_at = stage([[i for i, _, _ in bias], [t for _, t, _ in bias]], torch.int64, (2, len(bias)))
        self.bias_values = stage([b for _, _, b in bias], torch.float32)
        allowed = [(i, t) for i, p in enumerate(params) for t in p.allowed_token_ids]
        self.allowed_rows = stage(sorted({i for i, _ in allowed}), torch.int64)
        self.allowed_at = stage([[i for i, _ in allowed], [t for _, t in allowed]], torch.int64, (2, len(allowed)))
        banned = [
            (i, t)
            for i, (s, p) in enumerate(zip(slots, params))
            if table.generated[s] < p.min_new_tokens
            for t in list(p.stop_token_ids) + ([] if p.ignore_eos else table.eos_token_ids)
        ]
        banned += [
            (i, t)
            for i, (s, p) in enumerate(zip(slots, params))
            if s in table.recent_ids
            for t in banned_tokens(p, table.recent_ids[s])
        ]
        self.banned_at = stage([[i for i, _ in banned], [t for _, t in banned]], torch.int64, (2, len(banned)))
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        self.seeded_rows = stage(seeded, torch.int64)
        self.seeded_keys = stage([row_key(params[i].seed, table.generated[slots[i]]) for i in seeded], torch.int64)
        table.staging.flush()

    def column(self, name: str) -> torch.Tensor:
        return self.values[:, PARAM_COLUMNS.index(name)]


def sample(
    logits: torch.Tensor,
    slots: list[int],
    table: SamplingTable,
    agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, list[RowLogprobs | None]]:
    """logits [rows, vocab] in the model's dtype -> (token ids [rows] int64, per-row logprobs or []).

    A batch of plain greedy rows takes the argmax of the logits as they are (converting
    them cannot change which is largest) and sends nothing to the device. Greedy rows that
    need only their stop tokens masked (short of min_tokens) also keep the logits' dtype: a
    float32 copy of a large vocabulary's logits costs many times the argmax. Anything else
    works on float32 logits with the rows' parameters staged once (RowParams).
    `agree` makes the tensor-parallel ranks take one set of tokens (rank 0's) before any
    per-row state (penalty counts, logprobs, grammar matchers) is updated from them."""
    params = [table.params[s] for s in slots]
    all_greedy = all(p.temperature <= 0.0 for p in params)
    greedy_as_is = all_greedy and not any(
        p.logprobs or p.logit_bias or p.allowed_token_ids or p.bad_words_ids or p.grammar or _uses_penalties(p)
        for p in params
    )
    plain = greedy_as_is and not any(table.generated[s] < p.min_new_tokens for s, p in zip(slots, params))
    rows = None if plain and table.output_counts is None else RowParams(params, slots, table)
    if not greedy_as_is:
        logits = logits.float()
    raw_logprobs = None
    if any(p.logprobs for p in params):
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    if rows is not None:
        logits = _apply_penalties(logits, rows, params, table)
        logits = _apply_logit_bias_and_bans(logits, rows)
    constrained = table.grammars.constrained(slots) if table.grammars is not None else []
    if constrained:
        logits = table.grammars.apply_masks(logits, slots, constrained)

    tokens = table.argmax(logits)
    if not all_greedy:
        assert rows is not None
        temperature = rows.column("temperature")
        probs = torch.softmax(logits / temperature.clamp_min(1e-6)[:, None], dim=-1)
        probs = _filter_top_k_top_p_min_p(probs, rows, params)
        tokens = torch.where(temperature <= 0.0, tokens, _draw(probs, rows, table))
    if agree is not None:
        tokens = agree(tokens)
    table.note_sampled(slots, tokens, None if rows is None else rows.slots)
    return tokens, _gather_logprobs(raw_logprobs, tokens, params)


def _apply_penalties(logits, rows: RowParams, params, table: SamplingTable) -> torch.Tensor:
    if table.output_counts is None or not any(_uses_penalties(p) for p in params):
        return logits
    counts = table.output_counts[rows.slots].float()
    freq, pres, rep = (rows.column(c)[:, None] for c in ("frequency_penalty", "presence_penalty", "repetition_penalty"))
    seen = (counts > 0) | table.prompt_seen[rows.slots]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    return logits - freq * counts - pres * (counts > 0).float()


def _apply_logit_bias_and_bans(logits: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """OpenAI's logit_bias (each (token, bias) pair added to its row's logit); then -inf on every
    token but the allowed ones of rows that name some; then -inf on the banned tokens (stop
    tokens of rows short of min_new_tokens, bad words' last tokens): a few indexed ops for all rows."""
    if not (rows.bias_at.shape[1] or rows.allowed_at.shape[1] or rows.banned_at.shape[1]):
        return logits
    logits = logits.clone()
    if rows.bias_at.shape[1]:
        logits.index_put_((rows.bias_at[0], rows.bias_at[1]), rows.bias_values.to(logits.dtype), accumulate=True)
    if rows.allowed_at.shape[1]:
        kept = logits[rows.allowed_at[0], rows.allowed_at[1]]
        logits[rows.allowed_rows] = NEG_INF
        logits[rows.allowed_at[0], rows.allowed_at[1]] = kept
    if rows.banned_at.shape[1]:
        logits[rows.banned_at[0], rows.banned_at[1]] = NEG_INF
    return logits


def _filter_top_k_top_p_min_p(probs: torch.Tensor, rows: RowParams, params: list[SamplingParams]) -> torch.Tensor:
    if all(p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0 for p in params):
        return probs
    vocab = probs.shape[-1]
    top_k, top_p, min_p = (rows.column(c)[:, None] for c in ("top_k", "top_p", "min_p"))
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=probs.device)[None, :]
    cum_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = (rank < top_k) & (cum_before < top_p)
    keep &= sorted_probs >= min_p * sorted_probs[:, :1]
    keep[:, 0] = True  # the most likely token always survives
    sorted_probs = sorted_probs * keep
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def _draw(probs: torch.Tensor, rows: RowParams, table: SamplingTable) -> torch.Tensor:
    """Exponential-race sampling: argmax(p / E), E ~ Exp(1). Unseeded rows take E from
    torch's generator, seeded rows from their keys (seeded_exponentials): two ops for the
    whole batch, none per row."""
    noise = torch.empty_like(probs).exponential_()
    if rows.seeded_rows.numel():
        noise[rows.seeded_rows] = seeded_exponentials(rows.seeded_keys, table.token_hashes())
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
