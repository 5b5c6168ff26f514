"""A recorded descriptor stream drives a worker alone to the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import REPO_ROOT, record_workload


def test_replayed_worker_samples_the_recorded_tokens(tmp_path):
    recording = record_workload(tmp_path, seed=7, num_prompts=8, max_new_tokens=24, chunk=8)
    assert os.path.getsize(recording) > 0
    out = str(tmp_path / "replay.json")
    res = subprocess.run(
        [sys.executable, "-m", "gpu_worker.replay", recording, "--json", out],
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
        [sys.executable, "-m", "gpu_worker.replay", str(bad)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 2 and "not a trident descriptor recording" in res.stderr
    assert "Traceback" not in res.stderr
