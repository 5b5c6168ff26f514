"""benchmarks/gpu_check.py, the one command that proves the CUDA path, runs on the CPU at
tiny sizes, so that it cannot rot while no GPU is around: every part runs and its JSON
says parity passed, the sync rule held, and the throughput numbers are there."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import REPO_ROOT

FAMILIES = "llama3_rope,gemma3"
"""A plain family and the one that differs most (windows, q/k norms, head dim 256): every
family's parity is tests/test_model_families.py's job; here the check's own code is."""


def test_gpu_check_runs_on_the_cpu_and_its_checks_pass(tmp_path):
    out = tmp_path / "gpu_check.json"
    cmd = [sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--families", FAMILIES, "--out", str(out)]
    res = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())

    assert report["parity"]["passed"] and set(report["parity"]["families"]) == set(FAMILIES.split(","))
    for family in report["parity"]["families"].values():
        assert family["greedy_fp32_equal"]

    syncs = report["syncs"]
    assert syncs["passed"], syncs
    assert syncs["per_step"]["worker_counters"]["seq_lens_d2h_copies"] == 1
    assert syncs["per_step"]["worker_counters"]["readbacks"] == 2  # seq_lens and the sampled tokens

    rows = [r["rows"] for r in report["throughput"]["results"]]
    assert rows == [1, 32, 128]
    for r in report["throughput"]["results"]:
        assert r["ms_per_step"] > 0 and r["tok_s"] > 0 and 0 < r["bandwidth_share"] < 1

    assert report["tp2"]["passed"], report["tp2"]
    assert "(a) parity: PASS" in res.stdout and "(d) tp 2: PASS" in res.stdout
