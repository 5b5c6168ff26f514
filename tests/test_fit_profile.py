"""Fitting a simulated worker's step-time profile: the least-squares fit itself, and the
command end to end on a recording of a real server."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from gpu_worker.sim.fit_profile import median_of_each_point, median_of_its_point
from gpu_worker.sim.profile_sweep import SweepTimes
from gpu_worker.sim.step_profile import (
    COEFFICIENT_NAMES,
    SHAPE,
    StepProfile,
    fit_idle_cores,
    fit_shapes,
    fit_step_times,
    ratio_quantiles,
)
from tests.helpers import REPO_ROOT, make_random_llama, record_workload, write_sim_profile

TRUE_MODEL = StepProfile(
    dict.fromkeys(COEFFICIENT_NAMES, 0.0)
    | {
        "const_s": 5e-3,
        "per_token_in_knee_s": 1e-5,
        "per_token_past_knee_s": 5e-5,
        "per_logit_row_s": 1e-5,
        "per_kv_read_s": 2e-8,
        "per_extend_pair_s": 2e-8,
        "per_extend_row_s": 2e-3,
    },
    token_knee=32,
)


def synthetic_shapes(rng: np.random.Generator, n: int) -> np.ndarray:
    """Decode rows with prefill chunks of 1-4 rows in some steps, in SHAPE order."""
    rows = rng.integers(1, 64, n)
    extend = rng.integers(0, 512, n) * (rng.random(n) < 0.3)
    extend_rows = np.where(extend > 0, rng.integers(1, 5, n), 0)
    return np.stack(
        [
            np.ones(n),
            rows + extend,
            rows,
            rows * rng.integers(10, 2000, n),
            extend * extend / 2,
            extend_rows,
            np.zeros(n),
        ],
        axis=1,
    )


def test_fit_recovers_known_coefficients_and_the_knee():
    rng = np.random.default_rng(0)
    shapes = synthetic_shapes(rng, 400)
    seconds = TRUE_MODEL.predict(shapes) * rng.normal(1.0, 0.02, len(shapes))
    knee, coef = fit_shapes(shapes, seconds)
    assert knee == TRUE_MODEL.token_knee
    true = TRUE_MODEL.vector()
    assert np.allclose(coef[true > 0], true[true > 0], rtol=0.15)
    assert coef[true == 0] == pytest.approx(0, abs=0.1 * true[0])  # absent terms stay small next to const


def test_fit_never_gives_a_negative_coefficient():
    """Pure decode: tokens and logit rows move together; noise must not make one negative."""
    rng = np.random.default_rng(1)
    rows = rng.integers(1, 64, 300).astype(float)
    features = np.stack([np.ones(300), rows, rows, rows * 100, np.zeros(300)], axis=1)
    seconds = 0.004 + 5e-5 * rows + rng.normal(0, 2e-4, 300)
    coef = fit_step_times(features, seconds)
    assert (coef >= 0).all() and coef[0] > 0
    assert np.median(np.abs(features @ coef - seconds) / seconds) < 0.05


def test_measured_spread_makes_simulated_steps_match_both_median_and_mean():
    """Step times with a heavy tail (a shared CPU): the prediction alone matches the typical
    step but not the mean; drawing each step's factor from the fitted spread matches both."""
    rng = np.random.default_rng(2)
    shapes = synthetic_shapes(rng, 2000)
    slowdown = np.where(rng.random(2000) < 0.1, rng.uniform(1.5, 4.0, 2000), rng.normal(1.0, 0.05, 2000))
    seconds = TRUE_MODEL.predict(shapes) * slowdown
    knee, coef = fit_shapes(shapes, seconds)
    exact_profile = StepProfile(dict(zip(COEFFICIENT_NAMES, coef)), token_knee=knee)
    exact = exact_profile.predict(shapes)
    profile = StepProfile(exact_profile.coefficients, token_knee=knee, step_time_ratios=ratio_quantiles(exact, seconds))
    draws = np.random.default_rng(3).random(len(shapes))
    spread = exact * np.asarray([profile.spread(u) for u in draws])
    assert abs(np.median(exact) / np.median(seconds) - 1) < 0.05
    assert exact.sum() / seconds.sum() < 0.9  # the tail is missing without the spread
    assert abs(np.median(spread) / np.median(seconds) - 1) < 0.05
    assert abs(spread.sum() / seconds.sum() - 1) < 0.05
    assert exact_profile.spread(0.99) == 1.0  # hand-written: exact


def test_a_sweeps_spread_is_its_shapes_repeats_not_the_models_misfit():
    """Shapes the model misses by up to 25 %, each the same way on every repeat, whose repeats
    differ by at most 3 %: simulated steps draw from the 3 % (the median step, which is
    what is fitted, at 1.0). Around the prediction the spread would hold the misfit, and a
    run's one big prefill step would be scaled by another shape's."""
    rng = np.random.default_rng(3)
    points, repeats = synthetic_shapes(rng, 40), 3
    misfit = 1 + 0.25 * np.sin(np.arange(len(points)))
    group = np.repeat(np.arange(len(points)), repeats)
    seconds = TRUE_MODEL.predict(points[group]) * misfit[group] * rng.uniform(1.0, 1.03, len(group))
    times = SweepTimes(points[group], seconds, group, ["decode"] * len(group))
    within = ratio_quantiles(median_of_its_point(times), seconds)
    assert within[50] == 1.0 and within[0] >= 1 / 1.03 and within[-1] <= 1.03
    knee, coef = fit_shapes(points, seconds[median_of_each_point(times)])
    around_prediction = ratio_quantiles(
        StepProfile(dict(zip(COEFFICIENT_NAMES, coef)), token_knee=knee).predict(points[group]), seconds
    )
    assert around_prediction[-1] / around_prediction[0] > 1.3


@pytest.mark.parametrize("path", ["cpu-zen3-smollm2-bf16.json", "h100-llama3.1-8b-bf16.json"])
def test_a_profile_written_before_the_later_terms_loads_with_them_at_zero(path):
    profile = StepProfile.load(os.path.join(REPO_ROOT, "trident", "profiles", path))
    decode_step = np.asarray([1.0, 8, 8, 8 * 100, 0, 0, 0])
    c = profile.coefficients
    expected = c["const_s"] + 8 * c["per_token_s"] + 8 * c["per_logit_row_s"] + 800 * c["per_kv_read_s"]
    assert profile.predict(decode_step) == pytest.approx(expected)


@pytest.mark.parametrize("exact", [False, True])
def test_a_simulated_step_takes_the_prediction_times_a_draw_from_the_spread(tmp_path, exact):
    from gpu_worker.sim.simulated import SimulatedWorker
    from trident.model_source import default_model_path
    from trident.wire.child import ChildContext
    from trident.wire.server_args import ServerArgs

    # A spread from 1x (lowest percentile) to 3x (highest): every draw lands in between.
    ratios = np.linspace(1.0, 3.0, 101).tolist()
    profile = write_sim_profile(str(tmp_path / "p.json"), const_s=0.01, per_token_s=0.001, step_time_ratios=ratios)
    args = ServerArgs(
        model_path=default_model_path(),
        run_dir=str(tmp_path),
        worker="simulated",
        sim_profile=profile,
        sim_step_spread=not exact,
    )
    worker = SimulatedWorker(ChildContext(args, "worker", 0))
    worker.last_step_features = np.asarray([1.0, 10.0, 10.0, 0.0, 0.0, 0.0, 0.0])  # predicted: 0.01 + 10 * 0.001 s
    times = np.asarray([worker.step_seconds() for _ in range(200)])
    if exact:
        assert np.allclose(times, 0.02)
    else:
        assert (times >= 0.02 - 1e-12).all() and (times <= 0.06 + 1e-12).all()
        assert 0.035 < np.median(times) < 0.045 and len(np.unique(times)) > 150


def test_a_simulated_step_adds_the_front_ends_measured_share(tmp_path):
    from gpu_worker.sim.simulated import SimulatedWorker
    from trident.model_source import default_model_path
    from trident.wire.child import ChildContext
    from trident.wire.server_args import ServerArgs

    path = write_sim_profile(str(tmp_path / "p.json"), const_s=0.01, per_token_s=0.001)
    profile = StepProfile.load(path)
    profile.frontend = {"per_step_s": 0.002, "per_sampling_row_s": 0.0005}
    profile.save(path)
    args = ServerArgs(model_path=default_model_path(), run_dir=str(tmp_path), worker="simulated", sim_profile=path)
    worker = SimulatedWorker(ChildContext(args, "worker", 0))
    worker.last_step_features = np.asarray([1.0, 10.0, 10.0, 0.0, 0.0, 0.0, 0.0])
    assert worker.step_seconds() == pytest.approx(0.01 + 10 * 0.001 + 0.002 + 10 * 0.0005)
    worker.last_step_features = np.zeros(len(SHAPE))  # an idle step: no front-end share either
    assert worker.step_seconds() == 0.0


def test_the_median_step_of_each_point_is_what_the_fit_sees():
    """Points timed 1, 2, 3 and 4 times, in mixed order: each keeps its middle step (the lower
    of the middle two for an even count), and every step's reference is its point's."""
    group = np.asarray([2, 0, 1, 2, 3, 1, 3, 2, 3, 3])
    seconds = np.asarray([0.5, 0.1, 0.3, 0.2, 0.9, 0.4, 0.6, 0.4, 0.8, 0.7])
    times = SweepTimes(np.zeros((len(group), len(SHAPE))), seconds, group, ["decode"] * len(group))
    assert seconds[median_of_each_point(times)].tolist() == [0.1, 0.3, 0.4, 0.7]
    assert median_of_its_point(times).tolist() == [0.4, 0.1, 0.3, 0.4, 0.7, 0.3, 0.7, 0.4, 0.7, 0.7]


def test_idle_cores_are_kept_by_token_count_and_read_as_a_share_of_the_step():
    """Swept steps on 2 threads whose idle cores fall from one (1 and 2 rows: one thread
    works) to a fifth (4 rows) to 0.05 (8 tokens and up), the shape a real sweep shows: the
    profile keeps each power of two's median, and a step between them reads the
    interpolation, times its own length. A step's CPU read a little past 2 x its time (the
    last step's tail) counts as no idle core, not as a negative one."""
    rng = np.random.default_rng(4)
    tokens = np.repeat([1, 2, 4, 8, 64, 512], 9).astype(float)
    idle = np.interp(np.log2(tokens), np.log2([1, 2, 4, 8]), [1.0, 0.98, 0.2, 0.05])
    seconds = rng.uniform(0.005, 0.5, len(tokens))
    noise = rng.normal(0.0, 0.01, len(tokens))
    cpu = (2 - idle + noise) * seconds
    cpu[-1] = 2.1 * seconds[-1]
    table = fit_idle_cores(tokens, seconds, cpu, threads=2)
    assert [n for n, _ in table] == [1, 2, 4, 8, 64, 512]
    assert np.allclose([c for _, c in table], [1.0, 0.98, 0.2, 0.05, 0.05, 0.05], atol=0.02)
    profile = StepProfile(TRUE_MODEL.coefficients, idle_cores_by_tokens=table)
    step = np.asarray([1.0, 1, 1, 100, 0, 0, 0])
    assert profile.idle_core_seconds(step, 0.01) == pytest.approx(0.01 * table[0][1])
    step[1] = 16  # a third of the way from 8 to 64 on a log scale
    between = table[3][1] + (table[4][1] - table[3][1]) / 3
    assert profile.idle_core_seconds(step, 0.02) == pytest.approx(0.02 * between)
    step[1] = 8192  # past the largest swept step: its value
    assert profile.idle_core_seconds(step, 1.0) == pytest.approx(table[-1][1])
    assert profile.idle_core_seconds(np.zeros(len(SHAPE)), 1.0) == 0.0  # an idle step
    assert TRUE_MODEL.idle_core_seconds(step, 1.0) == 0.0  # a profile without the table


def test_sweep_steps_read_kv_that_was_written_as_a_served_workers_do(tmp_path):
    """A swept row's cached prefix was never computed; its pages must hold written values all
    the same: attention over a pool left untouched reads the operating system's zero page
    from cache, much faster than written KV (docs/benchmarks.md, "Method"), and a profile
    fitted on that under-predicts every served step with long KV."""
    import time

    import torch

    from gpu_worker.sim.profile_sweep import ShapeTimer, StepShape, sweep_worker

    model = make_random_llama(str(tmp_path / "model"), hidden=64, max_position=512)
    worker = sweep_worker(model, "float32", 256, 8192)
    timer = ShapeTimer(worker, clock=time.process_time)
    timer.time_shape(StepShape(decode_rows=4, decode_kv=200), repeats=1)
    timer.time_shape(StepShape(prefill_rows=1, prefill_chunk=16, prefill_prefix=100), repeats=1)
    page_size = worker.args.page_size
    for layer in worker.kv_pool.kv:
        read = layer[page_size : (1 + 4 * 200) * page_size]  # the decode rows' pages at least
        assert torch.isfinite(read).all()
        assert (read != 0).float().mean() > 0.99  # values, not the zero page


def test_fit_profile_command_on_a_recording(tmp_path):
    recording = record_workload(tmp_path, seed=3, num_prompts=12, max_new_tokens=40, chunk=32)
    out = str(tmp_path / "profile.json")
    res = subprocess.run(
        [
            *(sys.executable, "-m", "gpu_worker.sim.fit_profile", recording, "-o", out),
            *("--description", "tiny test model", "--loss", "absolute"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    profile = StepProfile.load(out)
    coef = profile.vector()
    assert set(profile.coefficients) == set(COEFFICIENT_NAMES) and (coef >= 0).all() and coef[0] > 0
    assert profile.fit["steps"] >= 40 and profile.fit["decode_steps"] > 0
    # The absolute-error fit keeps the fitted steps' total time whatever the noise (with
    # `const` in the fit its residuals sum to zero); the default relative fit fits the typical
    # step, and its total on a shared machine's timings can miss by more than a few percent.
    assert abs(profile.fit["total_time_relative_error"]) < 0.05
    assert "fit_profile" in profile.source and os.path.basename(recording) in profile.source
    ratios = np.asarray(profile.step_time_ratios)
    assert len(ratios) == 101 and (np.diff(ratios) >= 0).all() and ratios[0] > 0
    decode_step = np.zeros(len(SHAPE))
    decode_step[:4] = [1, 8, 8, 8 * 100]
    assert 0 < profile.predict(decode_step) < 1.0
    # Replayed steps are the worker's alone: a simulated worker adds the front end live.
    assert profile.worker_threads >= 1 and profile.host_cores == os.cpu_count()
    assert profile.contention() is not None

    # The same recording combined with a small sweep of the recorded model, and as the
    # served run the front end's share is measured on.
    combined = str(tmp_path / "combined.json")
    res = subprocess.run(
        [
            *(sys.executable, "-m", "gpu_worker.sim.fit_profile", "--sweep", recording, "-o", combined),
            *("--frontend-from", recording, "--model", str(tmp_path / "model"), "--dtype", "float32"),
            *("--context-length", "256", "--max-prefill-tokens", "64", "--repeats", "2", "--max-total-tokens", "8192"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    both = StepProfile.load(combined)
    assert both.fit["steps"] > profile.fit["steps"] + 20  # the recording's steps and the sweep's points
    assert both.fit["frontend_fitted_on_steps"] > 0
    assert set(both.frontend) == {"per_step_s", "per_sampling_row_s"} and min(both.frontend.values()) >= 0
    assert both.contention() is None  # the fitted share replaces the live one


def test_fit_profile_rejects_a_file_that_is_not_a_recording(tmp_path):
    bad = tmp_path / "bad.rec"
    bad.write_bytes(b"hello")
    res = subprocess.run(
        [sys.executable, "-m", "gpu_worker.sim.fit_profile", str(bad), "-o", str(tmp_path / "p.json")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "not a trident descriptor recording" in res.stderr
