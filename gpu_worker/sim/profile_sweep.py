"""Time a real worker alone over a grid of step shapes, for `fit_profile --sweep`.

A recording holds only the step shapes of the workload it recorded (a decode-heavy run
has a handful of prefill steps), so a profile fitted on it guesses every other shape. A
sweep measures each kind of step the scheduler can send, across its range:

- decode: 1 to 256 rows, each with 32 tokens of KV up to the context;
- prefill: one row's chunk of 16 up to --max-prefill-tokens tokens after prefixes of
  several lengths, and several rows' chunks in one step (many short prompts at once);
- mixed: decode rows with one prefill chunk riding along;
- verify: decode rows that each check drafts.

No step needs real KV: a row joins the batch with a cached prefix of the length the shape
asks for (AddedRequest.prefix_len, as after a prefix-cache hit) and pages of its own, so
the shape costs one cheap set-up step, not a prefill of its whole KV. Those pages are
written before they are first handed out (`ShapeTimer._pages`): the pool is allocated
untouched, and attention over pages never written reads the operating system's one shared zero page
from cache, where a served worker reads KV its prefills wrote from memory. A shape is set up,
warmed by one untimed step, then timed `repeats` times; prefilling rows are replaced by
fresh ones each repeat, so every repeat has the same shape. Shapes whose KV would not
fit the worker's pool are left out (the server could not run them either).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from gpu_worker.runtime.ngram_drafter import NgramDrafter
from gpu_worker.runtime.worker_loop import WorkerLoop
from trident.wire.backend import (
    AddedRequest,
    BatchDescriptor,
    ExtendChunk,
    ForwardMode,
    PageAppends,
    StepResult,
)
from trident.wire.codec import pack_int32
from trident.wire.frontend import SamplingParams
from trident.wire.server_args import ServerArgs

MAX_DECODE_ROWS = 256
SWEEP_DRAFT_TOKENS = 4
"""The most drafts a verify shape checks per row; the sweep worker is built for this many."""
_FIRST_TOKEN = 1000
"""Prompt tokens are drawn above the special and single-byte ids."""


@dataclass(frozen=True)
class StepShape:
    """One point of the grid: what the timed step computes."""

    decode_rows: int = 0
    decode_kv: int = 0
    """KV tokens of each decoding row before the step."""
    drafts: int = 0
    """Drafts each decoding row verifies (0: a plain decode row)."""
    prefill_rows: int = 0
    prefill_chunk: int = 0
    """Tokens each prefilling row runs this step."""
    prefill_prefix: int = 0
    """KV tokens of each prefilling row before its chunk."""

    @property
    def kind(self) -> str:
        if self.prefill_rows and self.decode_rows:
            return "mixed"
        if self.prefill_rows:
            return "prefill"
        return "verify" if self.drafts else "decode"

    def decode_row_pages(self, timed_steps: int) -> int:
        """Pages a decoding row is given: its KV, what its steps add, and slack for drafts."""
        return self.decode_kv + (timed_steps + 1) * (1 + self.drafts) + 2

    def kv_tokens(self, timed_steps: int) -> int:
        """Pages the shape holds at its largest, with page size 1."""
        decode = self.decode_rows * self.decode_row_pages(timed_steps)
        return decode + self.prefill_rows * (self.prefill_prefix + self.prefill_chunk)

    def longest_row(self, timed_steps: int) -> int:
        return max(
            self.decode_row_pages(timed_steps) if self.decode_rows else 0, self.prefill_prefix + self.prefill_chunk
        )


def _doubling(lo: int, hi: int) -> list[int]:
    out = []
    while lo <= hi:
        out.append(lo)
        lo *= 2
    return out


def sweep_grid(context_length: int, max_prefill_tokens: int, kv_pool_tokens: int, repeats: int) -> list[StepShape]:
    """Every shape of the sweep that fits the context and the KV pool."""
    kv_lengths = [*_doubling(32, context_length // 4)[::2], context_length - 64]
    chunks = _doubling(16, max_prefill_tokens)
    shapes = [StepShape(decode_rows=r, decode_kv=kv) for r in _doubling(1, MAX_DECODE_ROWS) for kv in kv_lengths]
    # Long prefixes only under chunks the server cuts prompts into (--chunked-prefill-size,
    # 512 by default): a 2,048-token chunk after 4,096 tokens costs seconds and never runs.
    shapes += [
        StepShape(prefill_rows=1, prefill_chunk=c, prefill_prefix=p)
        for c in chunks
        for p in (0, 1024, context_length // 2)
        if p == 0 or (c <= 512 and p + c <= context_length - 64)
    ]
    shapes += [
        StepShape(prefill_rows=n, prefill_chunk=c)
        for n in (4, 16)
        for c in _doubling(16, max(16, max_prefill_tokens // n))
        if n * c <= max_prefill_tokens
    ]
    shapes += [
        StepShape(
            decode_rows=r, decode_kv=min(256, context_length // 4), prefill_rows=1, prefill_chunk=c, prefill_prefix=p
        )
        for r in (4, 32, 128)
        for c in (64, 512)
        for p in (0, min(1024, context_length // 4))
    ]
    shapes += [
        StepShape(decode_rows=r, decode_kv=kv, drafts=d)
        for r in (1, 8, 32)
        for kv in (min(128, context_length // 4), min(1024, context_length // 2))
        for d in (1, SWEEP_DRAFT_TOKENS)
    ]
    return [
        s
        for s in dict.fromkeys(shapes)
        if s.kv_tokens(repeats + 1) < kv_pool_tokens and s.longest_row(repeats + 1) < context_length
    ]


class FixedDrafter(NgramDrafter):
    """Stands in for the worker's n-gram drafter: every row proposes `k` drafts, so a verify
    shape has exactly the drafts it asks for (what they are does not change the step's cost)."""

    def propose(self, slot: int) -> np.ndarray:
        return np.full(self.k, _FIRST_TOKEN, dtype=np.int64)


class ShapeTimer:
    """Sends a worker the descriptors that build each shape, and times the shape's steps.

    Owns the worker's batch between shapes: each shape starts from an empty batch and an
    empty pool (page ids are handed out from 1 again)."""

    def __init__(self, worker: WorkerLoop, seed: int = 0, clock: Callable[[], float] = time.perf_counter) -> None:
        """`clock`: what a step's time is read from; wall time, as a served step takes it
        (CPU time of one thread is what neighbours cannot stretch: for tests)."""
        self.worker = worker
        self.clock = clock
        args = worker.args
        ngrams = args.speculative_ngram_min, args.speculative_ngram_max
        self.drafter = FixedDrafter(args.max_running_requests, 0, *ngrams)
        if worker.num_draft_tokens:
            worker.drafter = self.drafter  # type: ignore[attr-defined]
        self.step_id = worker.state.next_step_id
        self.rng = np.random.default_rng(seed)
        self.next_page = 1
        self.written_pages = 1
        """Pages below this hold written KV (page 0 is the pool's zeroed padding page)."""

    def _pages(self, n: int) -> list[int]:
        ids = list(range(self.next_page, self.next_page + n))
        self.next_page += n
        self._write_kv_below(self.next_page)
        return ids

    def _write_kv_below(self, page: int) -> None:
        """Fills the KV of pages up to `page` once, as prefills would have (see the module doc)."""
        pool = getattr(self.worker, "kv_pool", None)
        if pool is None or page <= self.written_pages:
            return
        size = self.worker.args.page_size
        for layer in pool.kv:
            layer[self.written_pages * size : page * size].uniform_(-1.0, 1.0)
        self.written_pages = page

    def _tokens(self, n: int) -> bytes:
        return pack_int32(self.rng.integers(_FIRST_TOKEN, self.worker.vocab_size, n))

    def _step(
        self, mode: ForwardMode, removed: list[int], added: list, pages: list, extends: list
    ) -> tuple[float, float]:
        """(the step's time by `clock`, the CPU every thread of this process used in it)."""
        desc = BatchDescriptor(self.step_id, int(mode), removed, added, PageAppends.of_rows(pages), extends, 0)
        self.step_id += 1
        start, cpu_start = self.clock(), time.process_time()
        out = self.worker.step(desc)
        elapsed, cpu = self.clock() - start, time.process_time() - cpu_start
        if not isinstance(out, StepResult):
            raise RuntimeError(f"sweep step {desc.step_id} failed: {out}")
        return elapsed, cpu

    def time_shape(self, shape: StepShape, repeats: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(features, seconds, CPU seconds) of the shape's timed steps (one row each)."""
        self.worker.state.reset(self.step_id)
        self.worker.on_reset()
        self.next_page = 1
        params = SamplingParams(max_new_tokens=1 << 20, temperature=0.0, ignore_eos=True)
        decode_slots = list(range(shape.decode_rows))
        if decode_slots:  # rows join at decode_kv - 1 cached tokens and run one: then they decode
            room = shape.decode_row_pages(repeats + 1)
            self._step(
                ForwardMode.EXTEND,
                [],
                [AddedRequest(s, shape.decode_kv - 1, params) for s in decode_slots],
                [(s, 0, self._pages(room)) for s in decode_slots],
                [ExtendChunk(s, self._tokens(1), True) for s in decode_slots],
            )
        self.drafter.k = shape.drafts
        prefill_pages = [self._pages(shape.prefill_prefix + shape.prefill_chunk) for _ in range(shape.prefill_rows)]
        mode = {"prefill": ForwardMode.EXTEND, "mixed": ForwardMode.MIXED}.get(shape.kind, ForwardMode.DECODE)
        features, seconds, cpu_seconds, previous = [], [], [], []
        for k in range(repeats + 1):  # the first is a warm-up
            fresh = [shape.decode_rows + (k % 2) * shape.prefill_rows + i for i in range(shape.prefill_rows)]
            elapsed, cpu = self._step(
                mode,
                previous,
                [AddedRequest(s, shape.prefill_prefix, params) for s in fresh],
                [(s, 0, ids) for s, ids in zip(fresh, prefill_pages)],
                [ExtendChunk(s, self._tokens(shape.prefill_chunk), False) for s in fresh],
            )
            previous = fresh
            if k:
                features.append(self.worker.last_step_features)
                seconds.append(elapsed)
                cpu_seconds.append(cpu)
        self.drafter.k = 0
        return np.stack(features), np.asarray(seconds), np.asarray(cpu_seconds)


def sweep_worker(model_path: str, dtype: str, context_length: int = 0, max_total_tokens: int = 0) -> WorkerLoop:
    """The model worker a server would start for this model (same threads, kernels and KV
    pool unless `max_total_tokens` sizes it), in this process, with room for 256 decoding
    rows and drafts to verify."""
    from gpu_worker.sim.replay import replay_worker

    args = ServerArgs(
        model_path=model_path,
        dtype=dtype,
        context_length=context_length,
        max_total_tokens=max_total_tokens,
        max_running_requests=MAX_DECODE_ROWS + 32,
        speculative_algorithm="ngram",
        speculative_num_draft_tokens=SWEEP_DRAFT_TOKENS,
    )
    return replay_worker(args)


@dataclass
class SweepTimes:
    shapes: np.ndarray
    """Every timed step's shape (step_profile.SHAPE), a row each."""
    seconds: np.ndarray
    """Each timed step's time, from its descriptor to its result."""
    group: np.ndarray
    """Which grid point each step timed (steps of one point share the index)."""
    kinds: list[str]
    """Each step's kind: decode, prefill, mixed or verify."""
    cpu_seconds: np.ndarray | None = None
    """Each timed step's CPU, every thread of the worker's process (None: not measured)."""


def run_sweep(
    worker: WorkerLoop,
    grid: list[StepShape],
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
    passes: int = 1,
) -> SweepTimes:
    """Times every shape of the grid `repeats` times in each of `passes` passes over the
    grid, with a progress bar.

    Passes spread a shape's timed steps over the sweep's minutes. A shared host's cores run
    at one speed for tens of seconds, then at another, and a served run lives through both;
    steps timed back to back see one."""
    timer = ShapeTimer(worker, clock=clock)
    shapes, seconds, cpu_seconds, group, kinds = [], [], [], [], []
    progress = tqdm(total=passes * len(grid), desc="sweeping step shapes", unit="shape")
    for i, shape in ((i, shape) for _ in range(passes) for i, shape in enumerate(grid)):
        f, s, c = timer.time_shape(shape, repeats)
        shapes.append(f)
        seconds.append(s)
        cpu_seconds.append(c)
        group += [i] * len(s)
        kinds += [shape.kind] * len(s)
        progress.update()
    progress.close()
    return SweepTimes(
        np.concatenate(shapes), np.concatenate(seconds), np.asarray(group), kinds, np.concatenate(cpu_seconds)
    )
