"""The C++ CPU kernels build into the user's cache, and a failed build is an error unless opted out."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from gpu_worker.kernels.cpu_kernels import ISA_FLAGS, kernel_cache_dir
from tests.helpers import REPO_ROOT


def load_kernels_in_a_fresh_process(
    cache_home, required: bool, compiler: str, path: str | None = None
) -> subprocess.CompletedProcess:
    code = (
        "from gpu_worker.kernels import cpu_kernels as k\n"
        f"k.require_kernels({required})\n"
        "print('loaded' if k.load_greedy_argmax() is not None else 'fallback')\n"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(cache_home), "CXX": compiler}
    if path is not None:
        env["PATH"] = path
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_build_directory_is_in_the_user_cache_not_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    build_dir = kernel_cache_dir(torch.backends.cpu.get_cpu_capability())
    assert build_dir.startswith(os.path.join(str(tmp_path), "trident", "cpu_kernels") + os.sep)
    assert torch.__version__ in build_dir


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ISA_FLAGS, reason="the kernels are made for AVX2 and AVX-512 CPUs"
)
def test_a_failed_build_is_an_error_naming_the_opt_out(tmp_path):
    res = load_kernels_in_a_fresh_process(tmp_path, required=True, compiler="/bin/false")
    assert res.returncode != 0
    assert "KernelBuildError: the C++ CPU kernels failed to build" in res.stderr
    assert "--decode-attention torch" in res.stderr


def test_the_opt_out_turns_a_failed_build_into_the_torch_fallback(tmp_path):
    res = load_kernels_in_a_fresh_process(tmp_path, required=False, compiler="/bin/false")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "fallback"


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ISA_FLAGS, reason="the kernels are made for AVX2 and AVX-512 CPUs"
)
def test_a_lock_left_by_a_killed_build_does_not_block_later_starts():
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    build_dir = kernel_cache_dir(torch.backends.cpu.get_cpu_capability())
    os.makedirs(build_dir, exist_ok=True)
    # What torch's build leaves when its process is SIGKILLed mid-build: its lock file.
    with open(os.path.join(build_dir, "lock"), "w"):
        pass
    res = load_kernels_in_a_fresh_process(cache_home, required=True, compiler=os.environ.get("CXX", "c++"))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "loaded"
    assert not os.path.exists(os.path.join(build_dir, "lock"))


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ISA_FLAGS, reason="the kernels are made for AVX2 and AVX-512 CPUs"
)
def test_a_start_under_the_system_path_reuses_the_kernels_built_under_ours():
    """An unactivated venv of the wheel sees only the system PATH, whose ninja (where there is
    one) may be another version: it must not rebuild what the package's ninja built."""
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    isa = torch.backends.cpu.get_cpu_capability()
    library = os.path.join(kernel_cache_dir(isa), f"trident_cpu_kernels_{isa.lower()}.so")
    compiler = os.environ.get("CXX", "c++")
    assert load_kernels_in_a_fresh_process(cache_home, True, compiler).stdout.strip() == "loaded"
    built = os.stat(library).st_mtime_ns
    res = load_kernels_in_a_fresh_process(cache_home, True, compiler, path="/usr/local/bin:/usr/bin:/bin")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "loaded"
    assert os.stat(library).st_mtime_ns == built, "the kernels were rebuilt"
