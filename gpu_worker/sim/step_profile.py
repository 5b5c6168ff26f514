"""A step-time profile: how long a worker step takes, as a function of the step's shape.

The model is linear in ten terms of a step (all counted before the step runs):

    t = const
      + general_step        * general_path      a step that is not plain decode (see below)
      + per_token           * tokens            every token computed goes through every weight matrix
      + per_token_in_knee   * min(tokens, token_knee)
      + per_token_past_knee * max(0, tokens - token_knee)
      + per_logit_row       * logit_rows        rows whose logits are computed (lm_head, sampling)
      + per_kv_read         * decode_kv_read    query-key pairs of decoding rows (attention reads KV)
      + per_extend_pair     * extend_pairs      query-key pairs of prefill chunks (the quadratic term)
      + per_extend_row      * extend_rows       prefilling rows (one attention call per row and layer)
      + per_verify_row      * verify_rows       decoding rows that verify drafts

A query at position p attends to p + 1 keys, so a row running q tokens after `prefix`
tokens has q * prefix + q * (q + 1) / 2 pairs.

Why these terms (docs/benchmarks.md has the sweep they were chosen on). A linear layer
reads its weights once per step however many tokens it runs, and then does work per
token: its time is close to max(weights read, tokens x work per token), a floor that
turns into a slope. `const` with `per_token` alone cannot bend, and a recording of one
workload fits the bend of that workload only (a fit on 64-row decode steps over-predicts
a 512-token prefill chunk or a one-row step). The two hinge terms let the fit give the
first `token_knee` tokens of a step one slope and the rest another, steeper (a floor of
weight reads that turns into compute) or shallower (wider matrix products run closer to
the cores' peak); the fit chooses the knee among KNEES, and with a knee fits the two
slopes in place of `per_token`. Attention grows with rows x KV length in decode
(`decode_kv_read`) and quadratically in a prefill chunk (`extend_pairs`). A prefill step
runs its rows' attention one row at a time (`extend_rows`), which is why sixteen short
prompts in one step cost more than one prompt of their total length. A plain decode step (every row one token)
runs the worker's flat loop of fused ops; any other step runs the module tree, whose
fixed cost per step is higher (`general_path` is 1 for those), and a row that verifies
drafts is checked on its own (`verify_rows`). No coefficient may be negative: the fit drops
a term rather than let more work take less time. On a GPU `const` is reading the weights
once per step; on a CPU it is that plus the per-step overhead of the loop.

A deterministic step takes the prediction; a measured one scatters around it (on a CPU
shared with the front end the same shape's time varies widely, with a long tail). A fitted
profile keeps that spread, as quantiles of measured / typical time
over its fitted steps (`step_time_ratios`), and a simulated worker scales each step by a
draw from them: without it, a simulation matches either the real run's median step (its
ITL) or its mean step (its throughput), never both. The typical time of a swept step is
its shape's median step over the sweep's passes (what the fit sees), so the spread is the
host's noise on one shape, its slow and fast spells included, and not the model's misfit
across shapes, which is the same on every step of a shape and would otherwise scale a
run's one big prefill step by another shape's error (fit_profile.median_of_its_point); a
recorded step, timed once, is typical at its prediction.

What a profile cannot see is the CPU the front end (tokenizer and scheduler) and a client
on the same host take from the worker's cores while a step runs: a swept worker runs
alone. A simulated server runs the real front end beside the same client, so a simulated
worker measures them live (sibling_cpu.py): each step is stretched by the CPU every other
process on the host used during it, less what the cores the profiled worker left idle
absorb. That needs no fit and follows whatever the front end
does on each kind of step (tokenizing a long prompt, streaming many rows); it needs the
profiled worker's threads and the host's cores (`worker_threads`, `host_cores`, which
`fit_profile --sweep` writes; a profile without them, like every GPU profile, simulates no
contention). Nor are the worker's own threads busy all the time: a thread that waits at a
barrier sleeps (omp_policy.py), and the front end's CPU fills that core-time before it
displaces anyone. How much a step leaves idle depends on how its work splits across the
threads, which its token count decides: a 1- or 2-row decode step runs on one thread and
leaves a core idle throughout, while from a few rows up only the serial work at the step's
ends is left (docs/benchmarks.md, "Method"). The sweep measures it per shape (threads x step
time - the process's CPU), and the profile keeps it as idle cores by token count
(`idle_cores_by_tokens`, fit_idle_cores), read as a fraction of the step's time: a model
linear in the step's terms could not fall from one idle core at 1 row to almost none at 8
(a fit on them gave every step the large steps' value, and was taken back).

The older alternative, `frontend`, holds a share fitted on one served recording
(`fit_profile --frontend-from`, the served steps' extra time over the prediction, per step
and per sampling row); a profile that has it uses it instead, and draws the spread around
prediction plus share (which is how it was measured).

Profiles are JSON files (trident/profiles/*.json): measured ones come from
`python -m gpu_worker.sim.fit_profile --sweep` or from recordings
(`python -m gpu_worker.sim.fit_profile RECORDING`); hand-written ones say in `source` where
their numbers come from.
"""

from __future__ import annotations

import functools
import itertools
import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from gpu_worker.sim.sibling_cpu import Contention

if TYPE_CHECKING:
    from gpu_worker.runtime.batch_state import StepPlan

SHAPE = ("computes", "tokens", "logit_rows", "decode_kv_read", "extend_pairs", "extend_rows", "verify_rows")
"""What a worker counts of each step (WorkerLoop.last_step_features); `computes` is 1 for a
step that runs the model, 0 for an idle one."""
TERMS = (
    "const",
    "general_path",
    "tokens",
    "tokens_in_knee",
    "tokens_past_knee",
    "logit_rows",
    "decode_kv_read",
    "extend_pairs",
    "extend_rows",
    "verify_rows",
)
COEFFICIENT_NAMES = (
    "const_s",
    "general_step_s",
    "per_token_s",
    "per_token_in_knee_s",
    "per_token_past_knee_s",
    "per_logit_row_s",
    "per_kv_read_s",
    "per_extend_pair_s",
    "per_extend_row_s",
    "per_verify_row_s",
)
LATER_COEFFICIENTS = (
    "general_step_s",
    "per_token_in_knee_s",
    "per_token_past_knee_s",
    "per_extend_row_s",
    "per_verify_row_s",
)
"""Terms added after the first profiles were written: a profile without them has them at 0."""
KNEES = (0, 8, 16, 32, 64, 128)
"""Token counts the fit tries as the hinge of the linear layers' cost (0: no hinge)."""
MODEL = (
    "step seconds = const_s + general_step_s * general_path + per_token_s * tokens"
    " + per_token_in_knee_s * min(tokens, token_knee) + per_token_past_knee_s * max(0, tokens - token_knee)"
    " + per_logit_row_s * logit_rows"
    " + per_kv_read_s * decode_kv_read + per_extend_pair_s * extend_pairs + per_extend_row_s * extend_rows"
    " + per_verify_row_s * verify_rows (gpu_worker/sim/step_profile.py)"
)
FRONTEND_NAMES = ("per_step_s", "per_sampling_row_s")


def query_key_pairs(q_lens: np.ndarray, prefixes: np.ndarray) -> int:
    return int((q_lens * prefixes + q_lens * (q_lens + 1) // 2).sum())


def step_features(row_lens: np.ndarray, plan: StepPlan | None) -> np.ndarray:
    """The step's shape in SHAPE order; `row_lens` are the rows' KV lengths before the step."""
    if plan is None:
        return np.zeros(len(SHAPE))
    extend = np.asarray([(n, prefix) for _, n, prefix, _ in plan.extend_rows], dtype=np.int64).reshape(-1, 2)
    short = np.asarray([(n, slot) for _, n, slot in plan.short_rows], dtype=np.int64).reshape(-1, 2)
    return np.asarray(
        [
            1.0,
            float(plan.q_lens.sum()),
            float(sum(plan.num_logits)),
            query_key_pairs(short[:, 0], row_lens[short[:, 1]]),
            query_key_pairs(extend[:, 0], extend[:, 1]),
            float(len(extend)),
            float((short[:, 0] > 1).sum()),
        ]
    )


def model_terms(shapes: np.ndarray, token_knee: int) -> np.ndarray:
    """The model's terms (TERMS order) of one step's shape, or of a matrix of them (a row each)."""
    shapes = np.asarray(shapes, dtype=np.float64)
    computes, tokens = shapes[..., 0:1], shapes[..., 1:2]
    general = computes * ((shapes[..., 5:6] > 0) | (shapes[..., 6:7] > 0))
    in_knee = np.minimum(tokens, token_knee)
    past_knee = np.maximum(0.0, tokens - token_knee) * (token_knee > 0)
    return np.concatenate([computes, general, tokens, in_knee, past_knee, shapes[..., 2:]], axis=-1)


@dataclass
class StepProfile:
    """Coefficients of the step-time model above, and what they describe."""

    coefficients: dict[str, float]
    """Seconds per unit of each term, keyed by COEFFICIENT_NAMES."""
    description: str = ""
    """Model, dtype, hardware."""
    cpu: str = ""
    """The CPU the profile was measured on (model name and instruction set), for CPU profiles."""
    token_knee: int = 0
    """Where the linear layers' cost bends (the hinge term); 0: no hinge."""
    frontend: dict[str, float] = field(default_factory=dict)
    """Seconds the front end's CPU adds to a served step on shared cores, keyed by
    FRONTEND_NAMES (fit_profile --frontend-from); empty: not measured, not simulated."""
    source: str = ""
    """How the numbers were obtained: the fitting command and recording, or the published
    figures a hand-written profile is derived from."""
    worker_threads: int = 0
    """Threads the profiled worker ran its forward on (fit_profile --sweep); 0: unknown, and
    the front end's contention is not simulated."""
    host_cores: int = 0
    """Cores the profiled worker's process could run on; 0: unknown (see `worker_threads`)."""
    kv_pool_tokens: int = 1_000_000
    """The KV pool a simulated worker advertises when --max-total-tokens is 0."""
    fit: dict = field(default_factory=dict)
    """Fit diagnostics (steps used, relative errors); empty for hand-written profiles."""
    step_time_ratios: list[float] = field(default_factory=list)
    """Measured / predicted step time at the 0th, 1st, ..., 100th percentile of the fitted
    steps (ratio_quantiles); empty for hand-written profiles, whose steps take the prediction."""
    idle_cores_by_tokens: list[list[float]] = field(default_factory=list)
    """[tokens, idle cores] pairs, tokens ascending: how many of the worker's threads' cores
    a swept step of that many tokens left idle on average (fit_idle_cores); between and
    beyond them, `idle_core_seconds` interpolates. Empty: none assumed (recorded and GPU
    profiles)."""

    def vector(self) -> np.ndarray:
        return np.asarray([self.coefficients.get(name, 0.0) for name in COEFFICIENT_NAMES])

    def predict(self, shapes: np.ndarray) -> np.ndarray | float:
        """Step seconds of the worker alone for one step's shape (SHAPE order), or for a
        matrix of them (one step per row)."""
        return model_terms(shapes, self.token_knee) @ self.vector()

    @functools.cached_property
    def _idle_cores_by_log2_tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """idle_cores_by_tokens as arrays, tokens on a log scale: built once, read every step."""
        tokens, idle_cores = np.asarray(self.idle_cores_by_tokens, dtype=np.float64).reshape(-1, 2).T
        return np.log2(tokens), idle_cores

    def idle_core_seconds(self, shape: np.ndarray, step_s: float) -> float:
        """Core-seconds the worker's own threads leave idle in a step of this shape lasting
        `step_s` (idle_cores_by_tokens): what other processes' CPU fills first (Contention)."""
        if not self.idle_cores_by_tokens or not shape[0]:
            return 0.0
        log2_tokens, idle_cores = self._idle_cores_by_log2_tokens
        return float(np.interp(np.log2(max(1.0, shape[1])), log2_tokens, idle_cores)) * step_s

    def frontend_seconds(self, shape: np.ndarray) -> float:
        """What the front end's CPU adds to a served step of this shape (0 if not measured)."""
        if not self.frontend or not shape[0]:
            return 0.0
        return self.frontend.get("per_step_s", 0.0) + self.frontend.get("per_sampling_row_s", 0.0) * shape[2]

    def contention(self) -> Contention | None:
        """How a simulated worker turns the front end's live CPU into step time; None where
        the profile does not say its threads and cores, or carries a fitted `frontend`."""
        if self.frontend or not (self.worker_threads and self.host_cores):
            return None
        return Contention(self.worker_threads, self.host_cores)

    def spread(self, uniform: float) -> float:
        """The factor of a step drawn at `uniform` (in [0, 1]) from the measured spread; 1.0
        without one."""
        ratios = self.step_time_ratios
        if not ratios:
            return 1.0
        return float(np.interp(uniform, np.linspace(0.0, 1.0, len(ratios)), ratios))

    @classmethod
    def load(cls, path: str) -> StepProfile:
        """A profile written by this or an older version: coefficients added later
        (LATER_COEFFICIENTS) are 0 and fields added later take their defaults (an older CPU
        profile has no `worker_threads`, so it simulates as it did when it was written)."""
        with open(path) as f:
            raw = json.load(f)
        missing = [n for n in COEFFICIENT_NAMES if n not in raw.get("coefficients", {}) and n not in LATER_COEFFICIENTS]
        if missing:
            raise ValueError(f"{path}: profile lacks coefficients {missing}")
        return cls(**{k: v for k, v in raw.items() if k in cls.__dataclass_fields__})

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"model": MODEL, **asdict(self)}, f, indent=2)
            f.write("\n")


LOSSES = ("relative", "absolute")
RATIO_QUANTILES = 101


def ratio_quantiles(predicted: np.ndarray, seconds: np.ndarray) -> list[float]:
    """Percentiles of measured / predicted time over the steps (StepProfile.step_time_ratios)."""
    ratios = seconds[predicted > 0] / predicted[predicted > 0]
    if not len(ratios):
        return []
    return np.quantile(ratios, np.linspace(0.0, 1.0, RATIO_QUANTILES)).tolist()


def fit_step_times(features: np.ndarray, seconds: np.ndarray, loss: str = "relative") -> np.ndarray:
    """Non-negative least squares on each step's relative error (`relative`) or its error in
    seconds (`absolute`).

    `relative` fits the typical step of every size: a 40 ms decode step counts as much as a
    1 s prefill chunk. On a quiet machine this also keeps the total, where `absolute`
    over-predicts both the total and the median decode step (its few long prefill steps
    pull the per-row cost up). `absolute` keeps the fitted steps' total exactly (with
    `const` in the fit the residuals sum to zero), which is the safer choice when step times
    are heavy-tailed because neighbours share the machine: there `relative` under-predicts
    the total badly.

    No coefficient may be negative (a profile must never predict that more work takes less
    time); with ten terms the exact answer is cheap: fit every subset that keeps
    `const`, and keep the best fit whose coefficients are all non-negative."""
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, not {loss!r}")
    weight = 1.0 / seconds if loss == "relative" else np.ones_like(seconds)
    weighted, target = features * weight[:, None], seconds * weight
    best, best_residual = np.zeros(features.shape[1]), np.inf
    for subset in itertools.product([False, True], repeat=features.shape[1] - 1):
        active = np.asarray([True, *subset])
        coef = np.zeros(features.shape[1])
        coef[active] = np.linalg.lstsq(weighted[:, active], target, rcond=None)[0]
        residual = float(np.sum((weighted @ coef - target) ** 2))
        if (coef >= 0).all() and residual < best_residual:
            best, best_residual = coef, residual
    return best


def fit_shapes(shapes: np.ndarray, seconds: np.ndarray, loss: str = "relative") -> tuple[int, np.ndarray]:
    """(token_knee, coefficients) of the model that fits the steps best: one fit per knee of
    KNEES, judged by the same loss."""
    weight = 1.0 / seconds if loss == "relative" else np.ones_like(seconds)
    fits = []
    for knee in KNEES:
        terms = model_terms(shapes, knee)
        if knee:  # the slopes in and past the knee add up to tokens' own: one or the other
            terms[:, TERMS.index("tokens")] = 0.0
        coef = fit_step_times(terms, seconds, loss)
        fits.append((float(np.sum(((terms @ coef - seconds) * weight) ** 2)), knee, coef))
    _, knee, coef = min(fits, key=lambda f: f[0])
    return knee, coef


def fit_idle_cores(tokens: np.ndarray, seconds: np.ndarray, cpu_seconds: np.ndarray, threads: int) -> list[list[float]]:
    """StepProfile.idle_cores_by_tokens from timed steps: each step's idle cores (`threads` x
    its time, less the CPU its process used, over its time; clipped to [0, threads]: a step's
    CPU can include a little of the last one's, and spill past `threads` x time), their
    median over the steps of each power of two of tokens (rounded on a log scale), keyed by
    the median token count of those steps."""
    idle = np.clip((threads * seconds - cpu_seconds) / seconds, 0.0, float(threads))
    bucket = np.rint(np.log2(np.maximum(tokens, 1.0))).astype(np.int64)
    return [[float(np.median(tokens[bucket == b])), float(np.median(idle[bucket == b]))] for b in np.unique(bucket)]
