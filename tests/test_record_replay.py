"""A recorded descriptor stream drives a worker alone to the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from tests.helpers import REPO_ROOT, make_random_llama, running_server


def test_replayed_worker_samples_the_recorded_tokens(tmp_path):
    model = make_random_llama(str(tmp_path / "model"), seed=7)
    recording = str(tmp_path / "steps.rec")
    with running_server(
        [
            "--model",
            model,
            "--dtype",
            "float32",
            "--max-total-tokens",
            "8192",
            "--record-batches",
            recording,
            "--chunked-prefill-size",
            "8",
        ]
    ) as server:
        http = server.http()
        prompts = ["one two three " * n for n in range(1, 9)]
        with ThreadPoolExecutor(8) as pool:
            codes = list(
                pool.map(
                    lambda p: (
                        http.post(
                            "/generate",
                            json={
                                "text": p,
                                "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
                            },
                        ).status_code
                    ),
                    prompts,
                )
            )
        assert codes == [200] * 8
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
