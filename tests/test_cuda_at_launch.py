"""`--device cuda` where torch sees no GPU is a one-line error from launch.py (exit 2),
before any child starts: no traceback from a worker that tried to use CUDA."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO_ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: --device cuda starts")
def test_device_cuda_without_a_gpu_is_a_one_line_error():
    res = subprocess.run(
        [sys.executable, "launch.py", "--device", "cuda"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1 and lines[0].startswith("error: --device cuda, but torch"), res.stderr
    assert "Traceback" not in res.stdout + res.stderr
