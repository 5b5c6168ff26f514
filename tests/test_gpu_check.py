"""benchmarks/gpu_check.py, the one command that proves the CUDA path, runs on the CPU at
tiny sizes, so that it cannot rot while no GPU is around: every part runs and its JSON
says parity passed, the sync rule held, and the throughput numbers are there.

It runs twice: on the torch backend (the CPU's own path), and on the CUDA path's kernels,
`--attention-backend triton` under the Triton interpreter, where decode steps go through the
decode-graph runner (without capture) and parity is checked with the runner on and off."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT

FAMILIES = "llama3_rope,gemma3"
"""A plain family and the one that differs most (windows, q/k norms, head dim 256): every
family's parity is tests/test_model_families.py's job; here the check's own code is."""


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gpu_check_runs_on_the_cpu_and_its_checks_pass(tmp_path, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    out = tmp_path / "gpu_check.json"
    cmd = [sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--families", FAMILIES, "--out", str(out)]
    cmd += ["--attention-backend", backend]
    env = os.environ | ({"TRITON_INTERPRET": "1"} if backend == "triton" else {})
    res = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=1500, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["attention_backend"] == backend

    assert report["parity"]["passed"] and set(report["parity"]["families"]) == set(FAMILIES.split(","))
    for family in report["parity"]["families"].values():
        assert family["greedy_fp32_equal"] and family["greedy_fp32_equal_graphs_off"]
        assert family["decode_graphs"] == (backend == "triton")

    syncs = report["syncs"]
    assert syncs["passed"], syncs
    assert syncs["per_step"]["worker_counters"]["seq_lens_d2h_copies"] == 1
    assert syncs["per_step"]["worker_counters"]["readbacks"] == 2  # seq_lens and the sampled tokens

    throughput = report["throughput"]
    assert throughput["model"]["decode_graphs"] == (backend == "triton")
    assert [r["rows"] for r in throughput["results"]] == ([1, 2] if backend == "triton" else [1, 32, 128])
    for r in throughput["results"]:
        assert r["ms_per_step"] > 0 and r["tok_s"] > 0 and 0 < r["bandwidth_share"] < 1
        assert r["ms_per_step_graphs_off"] > 0

    assert report["tp2"]["passed"], report["tp2"]
    assert "(a) parity: PASS" in res.stdout and "(d) tp 2: PASS" in res.stdout
