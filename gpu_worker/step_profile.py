"""A step-time profile: how long a worker step takes, as a function of the step's shape.

The model is linear in five features of a step (all counted before the step runs):

    t = const
      + per_token       * tokens          every token computed goes through every weight matrix
      + per_logit_row   * logit_rows      rows whose logits are computed (lm_head, sampling)
      + per_kv_read     * decode_kv_read  query-key pairs of decoding rows (attention reads KV)
      + per_extend_pair * extend_pairs    query-key pairs of prefill chunks (the quadratic term)

A query at position p attends to p + 1 keys, so a row running q tokens after `prefix`
tokens has q * prefix + q * (q + 1) / 2 pairs. On a GPU `const` is reading the weights
once per step; on a CPU it is the per-step overhead of the loop and the thread pool.

A deterministic step takes the prediction; a measured one scatters around it (on a CPU
shared with the front end, the same shape takes 0.8-1.5x its typical time, with a tail
past 3x). A fitted profile keeps that spread, as quantiles of measured / predicted time
over its fitted steps (`step_time_ratios`), and a simulated worker scales each step by a
draw from them: without it, a simulation matches either the real run's median step (its
ITL) or its mean step (its throughput), never both.

Profiles are JSON files (profiles/*.json): measured ones come from
`python -m gpu_worker.fit_profile RECORDING`, hand-written ones say in `source` where
their numbers come from.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from gpu_worker.batch_state import StepPlan

FEATURES = ("const", "tokens", "logit_rows", "decode_kv_read", "extend_pairs")
COEFFICIENT_NAMES = ("const_s", "per_token_s", "per_logit_row_s", "per_kv_read_s", "per_extend_pair_s")
MODEL = (
    "step seconds = const_s + per_token_s * tokens + per_logit_row_s * logit_rows"
    " + per_kv_read_s * decode_kv_read + per_extend_pair_s * extend_pairs (gpu_worker/step_profile.py)"
)


def query_key_pairs(q_lens: np.ndarray, prefixes: np.ndarray) -> int:
    return int((q_lens * prefixes + q_lens * (q_lens + 1) // 2).sum())


def step_features(row_lens: np.ndarray, plan: StepPlan | None) -> np.ndarray:
    """The step's shape in FEATURES order; `row_lens` are the rows' KV lengths before the step."""
    if plan is None:
        return np.zeros(len(FEATURES))
    extend = np.asarray([(n, prefix) for _, n, prefix, _ in plan.extend_rows], dtype=np.int64).reshape(-1, 2)
    short = np.asarray([(n, slot) for _, n, slot in plan.short_rows], dtype=np.int64).reshape(-1, 2)
    return np.asarray(
        [
            1.0,
            float(plan.q_lens.sum()),
            float(sum(plan.num_logits)),
            query_key_pairs(short[:, 0], row_lens[short[:, 1]]),
            query_key_pairs(extend[:, 0], extend[:, 1]),
        ]
    )


@dataclass
class StepProfile:
    """Coefficients of the step-time model above, and what they describe."""

    coefficients: dict[str, float]
    """Seconds per unit of each feature, keyed by COEFFICIENT_NAMES."""
    description: str = ""
    """Model, dtype, hardware."""
    source: str = ""
    """How the numbers were obtained: the fitting command and recording, or the published
    figures a hand-written profile is derived from."""
    kv_pool_tokens: int = 1_000_000
    """The KV pool a simulated worker advertises when --max-total-tokens is 0."""
    fit: dict = field(default_factory=dict)
    """Fit diagnostics (steps used, relative errors); empty for hand-written profiles."""
    step_time_ratios: list[float] = field(default_factory=list)
    """Measured / predicted step time at the 0th, 1st, ..., 100th percentile of the fitted
    steps (ratio_quantiles); empty for hand-written profiles, whose steps take the prediction."""

    def vector(self) -> np.ndarray:
        return np.asarray([self.coefficients[name] for name in COEFFICIENT_NAMES])

    def predict(self, features: np.ndarray) -> np.ndarray | float:
        """Step seconds for one feature vector, or for a matrix of them (one step per row)."""
        return features @ self.vector()

    def spread(self, uniform: float) -> float:
        """The factor of a step drawn at `uniform` (in [0, 1]) from the measured spread; 1.0
        without one."""
        ratios = self.step_time_ratios
        if not ratios:
            return 1.0
        return float(np.interp(uniform, np.linspace(0.0, 1.0, len(ratios)), ratios))

    @classmethod
    def load(cls, path: str) -> StepProfile:
        with open(path) as f:
            raw = json.load(f)
        missing = [n for n in COEFFICIENT_NAMES if n not in raw.get("coefficients", {})]
        if missing:
            raise ValueError(f"{path}: profile lacks coefficients {missing}")
        return cls(**{k: v for k, v in raw.items() if k in cls.__dataclass_fields__})

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"model": MODEL, **asdict(self)}, f, indent=2)
            f.write("\n")


LOSSES = ("relative", "absolute")
RATIO_QUANTILES = 101


def ratio_quantiles(features: np.ndarray, seconds: np.ndarray, coef: np.ndarray) -> list[float]:
    """Percentiles of measured / predicted time over the steps (StepProfile.step_time_ratios)."""
    predicted = features @ coef
    ratios = seconds[predicted > 0] / predicted[predicted > 0]
    if not len(ratios):
        return []
    return np.quantile(ratios, np.linspace(0.0, 1.0, RATIO_QUANTILES)).tolist()


def fit_step_times(features: np.ndarray, seconds: np.ndarray, loss: str = "relative") -> np.ndarray:
    """Non-negative least squares on each step's relative error (`relative`) or its error in
    seconds (`absolute`).

    `relative` fits the typical step of every size: a 40 ms decode step counts as much as a
    1 s prefill chunk. On a quiet machine this also keeps the total: in docs/benchmarks.md's
    fit it predicted an unseen workload's total step time within 0.1 % and its median decode
    step within 1 %, where `absolute` over-predicted both by 9 % (its few long prefill
    steps pull the per-row cost up). `absolute` keeps the fitted steps' total exactly (with
    `const` in the fit the residuals sum to zero), which is the safer choice when step times
    are heavy-tailed because neighbours share the machine: there `relative` under-predicted
    the total by 65 %.

    No coefficient may be negative (a profile must never predict that more work takes less
    time); with five features the exact answer is cheap: fit every subset that keeps
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
