"""A recorded descriptor stream drives a worker alone to the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import REPO_ROOT, make_random_llama, record_workload


def test_replayed_worker_samples_the_recorded_tokens(tmp_path):
    recording = record_workload(tmp_path, seed=7, num_prompts=8, max_new_tokens=24, chunk=8)
    assert os.path.getsize(recording) > 0
    out = str(tmp_path / "replay.json")
    res = subprocess.run(
        [sys.executable, "-m", "gpu_worker.sim.replay", recording, "--json", out],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.load(open(out))
    assert report["steps_mismatched"] == 0 and report["steps_matched"] >= 24
    assert report["replayed_tokens_per_s"] > 0 and report["engine_efficiency"] > 0


def test_a_corrupt_recording_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.rec"
    bad.write_bytes(b"hello")
    res = subprocess.run(
        [sys.executable, "-m", "gpu_worker.sim.replay", str(bad)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "not a trident descriptor recording" in res.stderr
    assert "Traceback" not in res.stderr


def test_engine_efficiency_bench_pairs_a_served_run_with_its_replay(tmp_path):
    model = make_random_llama(str(tmp_path / "model"), seed=3)
    out = tmp_path / "efficiency.json"
    launch = f"{sys.executable} launch.py --model {model} --dtype float32 --max-total-tokens 8192"
    cmd = [sys.executable, os.path.join(REPO_ROOT, "benchmarks", "bench_engine_efficiency.py"), "--rounds", "2"]
    cmd += ["--launch", launch, "--tokenizer", "none", "--dataset", "random", "--num-prompts", "6"]
    cmd += ["--random-input-len", "12", "--random-output-len", "10", "--max-concurrency", "3", "--disable-tqdm"]
    proc = subprocess.run([*cmd, "--output-json", str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert len(doc["rounds"]) == 2
    for r in doc["rounds"]:
        # Every decode step replayed to the served tokens; all 6 x 10 tokens were sampled and served.
        assert r["steps_mismatched"] == 0 and r["steps_matched"] >= 10
        assert r["failed_requests"] == 0 and r["client_output_tokens_per_s"] > 0
        assert r["engine_efficiency"] == r["served_tokens_per_s"] / r["replayed_tokens_per_s"]
    assert (
        min(doc["engine_efficiency_min_max"])
        <= doc["engine_efficiency_median"]
        <= max(doc["engine_efficiency_min_max"])
    )
