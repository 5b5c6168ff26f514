"""Fit a simulated worker's step-time profile from recordings:
`python -m gpu_worker.fit_profile RECORDING [RECORDING ...] -o PROFILE.json`.

Each step's shape (step_profile.FEATURES) comes from replaying the recording's
descriptors through a worker's batch state; its time comes from one of:

- `--timing replay` (default): the recording is replayed on the real model worker in this
  process (gpu_worker.replay), `--passes` times, and each step is timed from the moment its
  descriptor is applied to its result; a step keeps the fastest of its passes, since on a
  shared machine the slower ones measure the neighbours;
- `--timing recorded`: the forward time the model worker itself reported for the step
  while it served the recorded run (StepResult.forward_time_s). No model is loaded, and
  the times are those of the real served run, contention included. Not for recordings with
  speculative decoding: there accepted lengths, which a replay without the model does not
  know, decide the shapes.

The coefficients are fitted by non-negative least squares (`--loss relative`, the default,
or `absolute`: step_profile.fit_step_times says when each is right); the fit's own errors,
and the spread of measured around predicted step times that a simulated worker replays,
are written into the profile.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time

import msgspec
import numpy as np

from gpu_worker.malloc_policy import keep_freed_memory
from gpu_worker.omp_policy import use_passive_omp_wait
from gpu_worker.replay import load_recording, replay_steps, replay_worker
from gpu_worker.step_profile import (
    COEFFICIENT_NAMES,
    FEATURES,
    LOSSES,
    StepProfile,
    fit_step_times,
    ratio_quantiles,
)
from trident.wire.backend import BatchDescriptor
from trident.wire.child import ChildContext


def time_recording(path: str, passes: int, overrides: dict) -> tuple[np.ndarray, np.ndarray]:
    """(features, seconds) of every computing step of a recording, fastest of `passes`."""
    rec = load_recording(path)
    worker = replay_worker(rec.args, **overrides)
    features: dict[int, np.ndarray] = {}
    seconds: dict[int, float] = {}
    first_step = next((m.step_id for m in rec.sent if isinstance(m, BatchDescriptor)), 1)
    for k in range(passes):
        worker.state.reset(first_step)  # each pass starts from an empty batch, as the recording did
        worker.on_reset()
        for step_id, _ in replay_steps(worker, rec.sent, desc=f"{path} pass {k + 1}/{passes}"):
            elapsed = time.perf_counter() - worker.step_started
            if worker.last_step_features[0]:  # an idle step computes nothing
                features[step_id] = worker.last_step_features
                seconds[step_id] = min(seconds.get(step_id, elapsed), elapsed)
    ids = sorted(features)
    return np.stack([features[i] for i in ids]), np.asarray([seconds[i] for i in ids])


def recorded_timings(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(features, seconds) of every computing step, with the forward times the recording holds."""
    from gpu_worker.simulated import SimulatedWorker  # imports torch: not before main() sets the OpenMP policy

    rec = load_recording(path)
    if rec.args.speculative_algorithm:
        raise ValueError(f"{path}: --timing recorded needs a recording without speculative decoding")
    run_dir = tempfile.mkdtemp(prefix="trident-fit-")
    no_sleep = os.path.join(run_dir, "zero.json")
    StepProfile(dict.fromkeys(COEFFICIENT_NAMES, 0.0)).save(no_sleep)
    args = msgspec.structs.replace(
        rec.args, run_dir=run_dir, worker="simulated", sim_profile=no_sleep, check_seq_lens=False, tp_size=1
    )
    shapes = SimulatedWorker(ChildContext(args, "worker", 0))
    features, seconds = [], []
    for step_id, _ in replay_steps(shapes, rec.sent, desc=f"{path} shapes"):
        result = rec.results.get(step_id)
        if result is not None and shapes.last_step_features[0]:
            features.append(shapes.last_step_features)
            seconds.append(result.forward_time_s)
    return np.stack(features), np.asarray(seconds)


def fit_report(features: np.ndarray, seconds: np.ndarray, coef: np.ndarray) -> dict:
    rel = np.abs(features @ coef - seconds) / seconds
    decode_only = features[:, FEATURES.index("extend_pairs")] == 0
    return {
        "steps": int(len(seconds)),
        "median_step_s": float(np.median(seconds)),
        "median_abs_relative_error": float(np.median(rel)),
        "p90_abs_relative_error": float(np.quantile(rel, 0.9)),
        "total_time_relative_error": float((features @ coef).sum() / seconds.sum() - 1),
        "decode_steps": int(decode_only.sum()),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recordings", nargs="+")
    p.add_argument("-o", "--output", required=True, help="profile JSON to write")
    p.add_argument("--description", default="", help="model, dtype and hardware the profile describes")
    p.add_argument("--timing", choices=["replay", "recorded"], default="replay", help="where step times come from")
    p.add_argument("--passes", type=int, default=2, help="replays per recording; each step keeps its fastest")
    p.add_argument(
        "--loss",
        choices=LOSSES,
        default="relative",
        help="relative: fit the typical step (quiet machine); absolute: keep the total (heavy-tailed times)",
    )
    p.add_argument("--kv-pool-tokens", type=int, default=1_000_000, help="KV pool a simulated worker advertises")
    p.add_argument("--model", default=None, help="override the recorded model path")
    p.add_argument("--dtype", default=None, help="override the recorded dtype")
    ns = p.parse_args(argv)
    use_passive_omp_wait()  # replayed step times must be the served worker's: same OpenMP policy
    keep_freed_memory()
    logging.basicConfig(level="WARNING")
    overrides = {k: v for k, v in (("model_path", ns.model), ("dtype", ns.dtype)) if v}
    try:
        if ns.timing == "recorded":
            timed = [recorded_timings(path) for path in ns.recordings]
        else:
            timed = [time_recording(path, ns.passes, overrides) for path in ns.recordings]
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    features = np.concatenate([f for f, _ in timed])
    seconds = np.concatenate([s for _, s in timed])
    if len(seconds) < len(FEATURES):
        print(f"error: {len(seconds)} computing steps are too few to fit {len(FEATURES)} coefficients", file=sys.stderr)
        return 2
    coef = fit_step_times(features, seconds, ns.loss)
    profile = StepProfile(
        coefficients=dict(zip(COEFFICIENT_NAMES, coef.tolist())),
        description=ns.description,
        source="python -m gpu_worker.fit_profile " + " ".join(argv if argv is not None else sys.argv[1:]),
        kv_pool_tokens=ns.kv_pool_tokens,
        fit=fit_report(features, seconds, coef),
        step_time_ratios=ratio_quantiles(features, seconds, coef),
    )
    profile.save(ns.output)
    print(f"wrote {ns.output}: {profile.coefficients}\nfit: {profile.fit}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
