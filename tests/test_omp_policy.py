"""The worker's OpenMP threads: how many it computes on, and how they wait (they spin briefly, then
sleep, unless the user chose otherwise)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers import REPO_ROOT

SET_THEN_IMPORT = (
    "import os\nfrom gpu_worker.runtime.omp_policy import use_passive_omp_wait\nuse_passive_omp_wait()\n"
    "import torch\nprint(os.environ['OMP_WAIT_POLICY'])"
)


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env={**clean, **env}, capture_output=True, text=True, timeout=120
    )


def test_the_worker_waits_passively_by_default_and_a_users_choice_wins():
    assert run(SET_THEN_IMPORT).stdout.strip() == "PASSIVE"
    assert run(SET_THEN_IMPORT, OMP_WAIT_POLICY="ACTIVE").stdout.strip() == "ACTIVE"


def test_threads_spin_briefly_before_sleeping_unless_the_user_set_a_policy():
    code = SET_THEN_IMPORT.replace("['OMP_WAIT_POLICY']", ".get('GOMP_SPINCOUNT')")
    assert run(code).stdout.strip() == "10000"
    assert run(code, OMP_WAIT_POLICY="ACTIVE").stdout.strip() == "None"  # ACTIVE keeps its own count
    assert run(code, GOMP_SPINCOUNT="0").stdout.strip() == "0"


def test_after_torch_is_loaded_it_is_too_late_and_says_so():
    code = "import os, torch\nfrom gpu_worker.runtime.omp_policy import use_passive_omp_wait\n"
    code += "print(use_passive_omp_wait(), os.environ.get('OMP_WAIT_POLICY'))"
    assert run(code).stdout.split() == ["False", "None"]


def test_a_worker_computes_on_its_cpus_shared_among_the_nodes_workers_unless_cpu_threads_is_set():
    from gpu_worker.runtime.worker import cpu_threads_per_worker
    from trident.wire.server_args import ServerArgs

    cpus = os.sched_getaffinity(0)
    args = ServerArgs(model_path="m")
    assert cpu_threads_per_worker(args) == len(cpus)
    assert cpu_threads_per_worker(ServerArgs(model_path="m", tp_size=len(cpus))) == 1
    assert cpu_threads_per_worker(ServerArgs(model_path="m", cpu_threads=3)) == 3
    try:
        os.sched_setaffinity(0, {min(cpus)})  # as `taskset -c 0` starts it: one CPU of the host's
        assert cpu_threads_per_worker(args) == 1
    finally:
        os.sched_setaffinity(0, cpus)
