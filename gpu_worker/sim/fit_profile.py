"""Fit a simulated worker's step-time profile from a sweep of step shapes, from
recordings, or from both:

    python -m gpu_worker.sim.fit_profile --sweep -o PROFILE.json [--model M] [--max-prefill-tokens N]
    python -m gpu_worker.sim.fit_profile RECORDING [RECORDING ...] -o PROFILE.json
    python -m gpu_worker.sim.fit_profile --sweep RECORDING ... -o PROFILE.json   (steps of both, one fit)

`--sweep` times the real model worker alone, in this process, over a grid of step shapes
(gpu_worker/sim/profile_sweep.py: decode, prefill, mixed and verify steps across their
ranges); no server and no recording is needed, and the fit sees every kind of step, not
only those of one workload. A shape is timed once in each of `--repeats` passes over the
grid, so that its steps sample the host's slow and fast spells as a served run does; it
keeps its median step for the fit, and the spread of all its steps around that median.

A profile whose steps were all timed on a worker alone (`--sweep`, `--timing replay`)
records the worker's threads and the cores it could run on: a simulated worker then
stretches each step, live, by the front end's CPU during it (gpu_worker/sim/sibling_cpu.py).
A sweep also measures each step's CPU, and keeps how many cores the worker's threads left
idle by the step's token count (step_profile.fit_idle_cores): the front end fills those
first.

`--frontend-from RECORDING` (with any of the above): a served run's recording, whose
steps were timed by the worker while the tokenizer and scheduler shared its cores. What
those steps took beyond the fitted prediction, per step and per sampling row, is the
front end's share (StepProfile.frontend); the served steps' spread around prediction plus
share replaces the sweep's, and the fitted share replaces the live one.

From recordings, each step's shape (step_profile.SHAPE) comes from replaying the
recording's descriptors through a worker's batch state; its time comes from one of:

- `--timing replay` (default): the recording is replayed on the real model worker in this
  process (gpu_worker.sim.replay), `--passes` times, and each step is timed from the moment its
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
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from gpu_worker.runtime.malloc_policy import keep_freed_memory
from gpu_worker.runtime.omp_policy import use_passive_omp_wait
from gpu_worker.sim.replay import load_recording, replay_steps, replay_worker
from gpu_worker.sim.step_profile import (
    COEFFICIENT_NAMES,
    FRONTEND_NAMES,
    LOSSES,
    SHAPE,
    TERMS,
    StepProfile,
    fit_idle_cores,
    fit_shapes,
    fit_step_times,
    ratio_quantiles,
)
from trident.wire.backend import BatchDescriptor, StepResult
from trident.wire.child import ChildContext
from trident.wire.recording import read_recording

if TYPE_CHECKING:
    from gpu_worker.sim.profile_sweep import SweepTimes  # imports torch: only inside main()


def time_recording(path: str, passes: int, overrides: dict) -> tuple[np.ndarray, np.ndarray]:
    """(shapes, seconds) of every computing step of a recording, fastest of `passes`."""
    rec = load_recording(path)
    worker = replay_worker(rec.args, **overrides)
    shapes: dict[int, np.ndarray] = {}
    seconds: dict[int, float] = {}
    first_step = next((m.step_id for m in rec.sent if isinstance(m, BatchDescriptor)), 1)
    for k in range(passes):
        worker.state.reset(first_step)  # each pass starts from an empty batch, as the recording did
        worker.on_reset()
        for step_id, _ in replay_steps(worker, rec.sent, desc=f"{path} pass {k + 1}/{passes}"):
            elapsed = time.perf_counter() - worker.step_started
            if worker.last_step_features[0]:  # an idle step computes nothing
                shapes[step_id] = worker.last_step_features
                seconds[step_id] = min(seconds.get(step_id, elapsed), elapsed)
    ids = sorted(shapes)
    return np.stack([shapes[i] for i in ids]), np.asarray([seconds[i] for i in ids])


def recorded_steps(path: str) -> Iterator[tuple[int, np.ndarray, StepResult]]:
    """(step id, shape, recorded result) of every step of a recording that has a result, in
    the order the scheduler sent them; shapes come from replaying the descriptors through a
    simulated worker's batch state (no model, no sleep)."""
    from gpu_worker.sim.simulated import SimulatedWorker  # imports torch: not before main() sets the OpenMP policy

    rec = load_recording(path)
    run_dir = tempfile.mkdtemp(prefix="trident-fit-")
    no_sleep = os.path.join(run_dir, "zero.json")
    StepProfile(dict.fromkeys(COEFFICIENT_NAMES, 0.0)).save(no_sleep)
    args = msgspec.structs.replace(
        rec.args, run_dir=run_dir, worker="simulated", sim_profile=no_sleep, check_seq_lens=False, tp_size=1
    )
    worker = SimulatedWorker(ChildContext(args, "worker", 0))
    for step_id, _ in replay_steps(worker, rec.sent, desc=f"{path} shapes"):
        result = rec.results.get(step_id)
        if result is not None:
            yield step_id, worker.last_step_features, result


def recorded_timings(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(shapes, seconds) of every computing step, with the forward times the recording holds."""
    if read_recording(path)[0].speculative_algorithm:  # the header only
        raise ValueError(f"{path}: recorded step times need a recording without speculative decoding")
    steps = [(shape, result.forward_time_s) for _, shape, result in recorded_steps(path) if shape[0]]
    return np.stack([s for s, _ in steps]), np.asarray([t for _, t in steps])


def step_kinds(shapes: np.ndarray) -> np.ndarray:
    """decode (verify included), prefill or mixed, from the shape alone: a prefill step has
    no more logit rows than prefilling rows (the prompts it finishes)."""
    extend_rows, logit_rows = shapes[:, SHAPE.index("extend_rows")], shapes[:, SHAPE.index("logit_rows")]
    return np.where(extend_rows == 0, "decode", np.where(logit_rows <= extend_rows, "prefill", "mixed"))


def fit_report(shapes: np.ndarray, seconds: np.ndarray, predicted: np.ndarray, kinds: np.ndarray) -> dict:
    rel = np.abs(predicted - seconds) / seconds
    report = {
        "steps": int(len(seconds)),
        "median_step_s": float(np.median(seconds)),
        "median_abs_relative_error": float(np.median(rel)),
        "p90_abs_relative_error": float(np.quantile(rel, 0.9)),
        "total_time_relative_error": float(predicted.sum() / seconds.sum() - 1),
        "decode_steps": int((shapes[:, SHAPE.index("extend_rows")] == 0).sum()),
    }
    for kind in sorted(set(kinds.tolist())):
        mask = kinds == kind
        report[f"{kind}_median_abs_relative_error"] = float(np.median(rel[mask]))
    return report


def this_cpu() -> str:
    """The CPU's model name, core count and the instructions that decide its kernels."""
    import torch

    name, flags = platform.processor() or "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    cores = len(os.sched_getaffinity(0))
    return f"{name}, {cores} cores, torch {torch.backends.cpu.get_cpu_capability()}, {' '.join(isa)}"


def worker_threads() -> int:
    """The threads the worker built in this process computes on (Worker sets them)."""
    import torch

    return torch.get_num_threads()


def sweep_timings(ns: argparse.Namespace) -> SweepTimes:
    from gpu_worker.sim.profile_sweep import run_sweep, sweep_grid, sweep_worker

    worker = sweep_worker(ns.model, ns.dtype or "auto", ns.context_length, ns.max_total_tokens)
    grid = sweep_grid(worker.context_length, ns.max_prefill_tokens, worker.num_pages - 1, 1)
    return run_sweep(worker, grid, 1, passes=ns.repeats)


def median_of_each_point(times: SweepTimes) -> np.ndarray:
    """Index of the median timed step of each grid point (the lower of the middle two for
    an even count). Not the fastest: on a shared host a shape timed in a fast spell of the
    cores would be predicted for a served run that also lives through the slow ones."""
    order = np.lexsort((times.seconds, times.group))
    starts = np.flatnonzero(np.r_[True, np.diff(times.group[order]) != 0])
    counts = np.diff(np.r_[starts, len(order)])
    return order[starts + (counts - 1) // 2]


def median_of_its_point(times: SweepTimes) -> np.ndarray:
    """Each timed step's reference for the spread: the median step of its grid point, which
    is what the fit sees. The steps of one shape scatter around it by the host's noise; the
    model's misfit of a shape is the same on every step, so it is left out: drawn at random
    per step it scaled a run's single big prefill step (and so its TTFT) by another shape's
    misfit (docs/benchmarks.md, "Simulated-worker fidelity")."""
    _, point = np.unique(times.group, return_inverse=True)  # median_of_each_point's order
    return times.seconds[median_of_each_point(times)][point]


def fit_frontend(profile: StepProfile, shapes: np.ndarray, seconds: np.ndarray) -> dict[str, float]:
    """The served steps' time beyond the prediction, per step and per sampling row
    (non-negative least squares on seconds: the share is a total, not a typical step)."""
    extra = seconds - profile.predict(shapes)
    coef = fit_step_times(shapes[:, [SHAPE.index("computes"), SHAPE.index("logit_rows")]], extra, "absolute")
    return dict(zip(FRONTEND_NAMES, coef.tolist()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recordings", nargs="*")
    p.add_argument("-o", "--output", required=True, help="profile JSON to write")
    p.add_argument("--sweep", action="store_true", help="time the model worker alone over a grid of step shapes")
    p.add_argument(
        "--repeats", type=int, default=3, help="--sweep: passes over the grid, timing each shape once (after a warm-up)"
    )
    p.add_argument("--max-prefill-tokens", type=int, default=2048, help="--sweep: the largest prefill chunk")
    p.add_argument("--context-length", type=int, default=0, help="--sweep: longest KV (0: the model's)")
    p.add_argument("--max-total-tokens", type=int, default=0, help="--sweep: KV pool (0: sized as a server sizes it)")
    p.add_argument("--frontend-from", default=None, help="a served run's recording: the front end's share")
    p.add_argument("--description", default="", help="model, dtype and hardware the profile describes")
    p.add_argument("--cpu", default=None, help="the CPU measured on (default: read from this machine)")
    p.add_argument("--timing", choices=["replay", "recorded"], default="replay", help="where step times come from")
    p.add_argument("--passes", type=int, default=2, help="replays per recording; each step keeps its fastest")
    p.add_argument(
        "--loss",
        choices=LOSSES,
        default="relative",
        help="relative: fit the typical step (quiet machine); absolute: keep the total (heavy-tailed times)",
    )
    p.add_argument("--kv-pool-tokens", type=int, default=1_000_000, help="KV pool a simulated worker advertises")
    p.add_argument("--model", default=None, help="the model (a .gguf file or a directory) to sweep or replay on")
    p.add_argument("--dtype", default=None, help="the dtype to sweep (default: auto), or to replay recordings in")
    ns = p.parse_args(argv)
    if not ns.sweep and not ns.recordings:
        p.error("give recordings, --sweep, or both")
    if ns.sweep and not ns.model:
        p.error("--sweep times a model: name it with --model (a .gguf file or a model directory)")
    use_passive_omp_wait()  # step times must be the served worker's: same OpenMP policy
    keep_freed_memory()
    logging.basicConfig(level="WARNING")
    overrides = {k: v for k, v in (("model_path", ns.model), ("dtype", ns.dtype)) if v}
    shapes, seconds, kinds, spread = [], [], [], []
    times = None
    try:
        if ns.sweep:
            times = sweep_timings(ns)
            medians = median_of_each_point(times)
            shapes.append(times.shapes[medians])
            seconds.append(times.seconds[medians])
            kinds += [times.kinds[i] for i in medians]
            spread.append((times.shapes, times.seconds, median_of_its_point(times)))
        for path in ns.recordings:
            timed = recorded_timings(path) if ns.timing == "recorded" else time_recording(path, ns.passes, overrides)
            shapes.append(timed[0])
            seconds.append(timed[1])
            kinds += step_kinds(timed[0]).tolist()
            spread.append((*timed, None))  # one time per step: around the prediction
        served = recorded_timings(ns.frontend_from) if ns.frontend_from else None
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    all_shapes, all_seconds = np.concatenate(shapes), np.concatenate(seconds)
    if len(all_seconds) < len(TERMS):
        print(f"error: {len(all_seconds)} computing steps are too few to fit {len(TERMS)} terms", file=sys.stderr)
        return 2
    knee, coef = fit_shapes(all_shapes, all_seconds, ns.loss)
    profile = StepProfile(
        coefficients=dict(zip(COEFFICIENT_NAMES, coef.tolist())),
        description=ns.description,
        cpu=ns.cpu or this_cpu(),
        token_knee=knee,
        source="python -m gpu_worker.sim.fit_profile " + " ".join(argv if argv is not None else sys.argv[1:]),
        kv_pool_tokens=ns.kv_pool_tokens,
    )
    if ns.timing == "replay" or not ns.recordings:  # every step timed on a worker alone
        profile.worker_threads, profile.host_cores = worker_threads(), len(os.sched_getaffinity(0))
    if times is not None and times.cpu_seconds is not None:
        tokens = times.shapes[:, SHAPE.index("tokens")]
        profile.idle_cores_by_tokens = fit_idle_cores(tokens, times.seconds, times.cpu_seconds, worker_threads())
    predicted = profile.predict(all_shapes)
    profile.fit = fit_report(all_shapes, all_seconds, predicted, np.asarray(kinds))
    if served is not None:
        profile.frontend = fit_frontend(profile, *served)
        spread = [(*served, profile.predict(served[0]) + np.asarray([profile.frontend_seconds(s) for s in served[0]]))]
        profile.fit["frontend_fitted_on_steps"] = int(len(served[1]))
    typical = np.concatenate([profile.predict(s) if ref is None else ref for s, _, ref in spread])
    profile.step_time_ratios = ratio_quantiles(typical, np.concatenate([t for _, t, _ in spread]))
    profile.save(ns.output)
    share = profile.frontend or ("live" if profile.contention() else "not simulated")
    print(
        f"wrote {ns.output}: knee {knee}, {profile.coefficients}\nfront end: {share}"
        f" (worker threads {profile.worker_threads}, host cores {profile.host_cores})\nfit: {profile.fit}"
        f"\nidle cores by tokens: {[(int(n), round(c, 3)) for n, c in profile.idle_cores_by_tokens]}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
