"""Step by step, where a simulated server's time goes apart from the real one's.

    python benchmarks/compare_step_timelines.py REAL.rec SIM.rec [--profile P] [--alone]

Each recording (`launch.py --record-batches FILE`, or bench_simulation.py --record-dir) is
read into one row per step: its kind (decode, prefill, mixed), rows, tokens, and from the
results the worker sent: when the result arrived, the worker's busy, idle and CPU time for
the step (its counters' growth) and its forward time. Steps are grouped by kind and rows, and
each group's tokens, busy seconds and share of the run (where the time went: a few prefill
steps can weigh as much as a hundred decode steps) are printed beside its medians, with the
profile's prediction of the same shapes; the first steps of the run (which decide the
first tokens' latency) are printed one by one.

`--alone` replays the first recording on the model worker in this process (no scheduler,
no tokenizer, nothing else on the cores) and adds each step's time alone and the worker's
CPU seconds over it (threads busy): served minus alone is what sharing the cores cost the
real worker, to set beside what the simulated worker added for the front end. Served CPU
against alone CPU says how it cost: at the same CPU seconds the served step was kept off its
cores; with more, it ran (or spun waiting) longer on them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_worker.runtime.malloc_policy import keep_freed_memory  # noqa: E402
from gpu_worker.runtime.omp_policy import use_passive_omp_wait  # noqa: E402
from gpu_worker.sim.fit_profile import recorded_steps, step_kinds  # noqa: E402
from gpu_worker.sim.replay import load_recording, replay_steps, replay_worker  # noqa: E402
from gpu_worker.sim.step_profile import SHAPE, StepProfile  # noqa: E402

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SEGMENT_GAP_S = 1.0
"""A pause this long between a result and the next step's start separates the benchmark's
warm-up from its run."""


def timeline(path: str) -> dict[str, np.ndarray]:
    """One entry per computing step of the recording's last segment (the benchmark run)."""
    ids, shapes, t, busy, idle, forward, cpu = [], [], [], [], [], [], []
    times = load_recording(path).result_times
    prev_busy = prev_idle = prev_cpu = 0.0
    for step_id, shape, result in recorded_steps(path):
        c = result.counters
        if shape[0]:
            ids.append(step_id)
            shapes.append(shape)
            t.append(times[step_id])
            busy.append(c.busy_s - prev_busy)
            idle.append(c.idle_s - prev_idle)
            forward.append(result.forward_time_s)
            cpu.append(c.cpu_s - prev_cpu if c.cpu_s else np.nan)  # nan: recorded before the counter
        prev_busy, prev_idle, prev_cpu = c.busy_s, c.idle_s, c.cpu_s
    t_arr = np.asarray(t)
    paused = np.diff(t_arr) - np.asarray(busy)[1:] > SEGMENT_GAP_S
    start = int(np.flatnonzero(np.r_[True, paused])[-1])
    period = np.r_[np.nan, np.diff(t_arr)]
    period[start] = np.nan
    out = {
        "step_id": np.asarray(ids),
        "shape": np.stack(shapes),
        "t": t_arr - t_arr[start],
        "period": period,
        "busy": np.asarray(busy),
        "idle": np.asarray(idle),
        "forward": np.asarray(forward),
        "cpu": np.asarray(cpu),
    }
    return {k: v[start:] for k, v in out.items()}


def alone_times(path: str, step_ids: np.ndarray, passes: int) -> tuple[np.ndarray, np.ndarray]:
    """(wall, worker CPU) seconds of each listed step replayed on the model worker alone,
    the fastest pass's."""
    rec = load_recording(path)
    worker = replay_worker(rec.args)
    wall = {int(i): np.inf for i in step_ids}
    cpu = dict.fromkeys(wall, 0.0)
    for _ in range(passes):
        worker.state.reset(next(m.step_id for m in rec.sent if hasattr(m, "step_id")))
        worker.on_reset()
        cpu_before = time.process_time()
        for step_id, _ in replay_steps(worker, rec.sent, desc=f"{path} alone"):
            elapsed, used = time.perf_counter() - worker.step_started, time.process_time() - cpu_before
            if step_id in wall and elapsed < wall[step_id]:
                wall[step_id], cpu[step_id] = elapsed, used
            cpu_before = time.process_time()
    return np.asarray([wall[int(i)] for i in step_ids]), np.asarray([cpu[int(i)] for i in step_ids])


def step_groups(shapes: np.ndarray) -> list[str]:
    kinds = step_kinds(shapes)
    rows = shapes[:, SHAPE.index("logit_rows")]
    bucket = [min(b for b in ROW_BUCKETS if b >= r) if r <= ROW_BUCKETS[-1] else int(r) for r in rows]
    return [
        f"{k} <={b} rows" if k != "prefill" else f"prefill {int(n)} rows"
        for k, b, n in zip(kinds, bucket, shapes[:, 5])
    ]


def report(name: str, tl: dict[str, np.ndarray], profile: StepProfile | None, first: int) -> None:
    predicted = profile.predict(tl["shape"]) if profile else np.full(len(tl["t"]), np.nan)
    columns = {k: tl[k] for k in ("period", "busy", "idle", "forward", "cpu")}
    columns["predicted"] = predicted
    if "alone" in tl:
        columns |= {"alone": tl["alone"], "alone_cpu": tl["alone_cpu"]}
    print(f"\n== {name}: {len(tl['t'])} computing steps over {tl['t'][-1]:.2f} s (ms, medians)")
    groups = np.asarray(step_groups(tl["shape"]))
    total_busy = np.nansum(tl["busy"])
    head = f"{'group':22} {'n':>4} {'kv/row':>7} {'tokens':>7} {'busy s':>7} {'share':>6} "
    print(head + " ".join(f"{c:>9}" for c in columns))
    for g in sorted(set(groups.tolist())):
        m = groups == g
        shape = tl["shape"][m]
        kv = np.median(shape[:, SHAPE.index("decode_kv_read")] / np.maximum(1, shape[:, SHAPE.index("logit_rows")]))
        tokens, busy = shape[:, SHAPE.index("tokens")].sum(), np.nansum(tl["busy"][m])
        cells = " ".join(f"{np.nanmedian(v[m]) * 1e3:9.2f}" for v in columns.values())
        print(f"{g:22} {int(m.sum()):4d} {kv:7.0f} {tokens:7.0f} {busy:7.2f} {busy / total_busy:6.1%} {cells}")
    print(f"first {first} steps: t, kind, rows, tokens | " + " ".join(columns))
    for i in range(min(first, len(tl["t"]))):
        s = tl["shape"][i]
        cells = " ".join(f"{v[i] * 1e3:8.1f}" for v in columns.values())
        print(f"{tl['t'][i]:7.3f} {groups[i]:20} {int(s[2]):4d} {int(s[1]):5d} | {cells}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recordings", nargs="+")
    p.add_argument("--profile", default=None, help="a profile whose predictions to print beside the steps")
    p.add_argument("--alone", action="store_true", help="replay the first recording on the model worker alone")
    p.add_argument("--passes", type=int, default=2, help="--alone: replays; each step keeps its fastest")
    p.add_argument("--first", type=int, default=8, help="steps printed one by one from the run's start")
    ns = p.parse_args(argv)
    use_passive_omp_wait()  # the served worker's OpenMP policy, before torch starts its threads
    keep_freed_memory()
    profile = StepProfile.load(ns.profile) if ns.profile else None
    for k, path in enumerate(ns.recordings):
        tl = timeline(path)
        if ns.alone and k == 0:
            tl["alone"], tl["alone_cpu"] = alone_times(path, tl["step_id"], ns.passes)
        report(path, tl, profile, ns.first)
    return 0


if __name__ == "__main__":
    sys.exit(main())
