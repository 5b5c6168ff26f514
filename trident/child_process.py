"""One child process of the launcher: how it is started, named, watched and stopped.

Each role is a package run with `python -m`; a child gets the run's ServerArgs file, the
launcher's pid (it exits when the launcher does, wire/child.py) and its ranks. A pidfd
sentinel lets the supervisor wait on deaths together with its sockets, without polling.
"""

from __future__ import annotations

import os
import site
import socket
import subprocess
import sys
from dataclasses import dataclass

from trident.wire.control import process_name

PACKAGES_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The folder that holds `trident/` and the process packages: a checkout, or site-packages."""
MODULE_OF_ROLE = {"worker": "gpu_worker", "scheduler": "scheduler_proc", "tokenizer": "tokenizer_proc"}
CHILD_ENV_DEFAULTS = {"NUMPY_MADVISE_HUGEPAGE": "0"}
"""Environment a child gets unless the user's environment says otherwise. numpy asks for 2 MB
pages for every large array; under THP's default `madvise` defrag each such first touch may
compact memory synchronously, and on a busy host that made the short-lived arrays of a GGUF
load many times slower (docs/benchmarks.md). Weights that do gain from huge pages get them
on purpose (gpu_worker/runtime/huge_pages.py)."""


def child_cwd(run_dir: str) -> str:
    """Where a child starts. `python -m` puts its working directory first on sys.path, so an
    installed server starts its children in the private run directory (nothing importable
    there), and only a checkout that was never installed starts them in the checkout, which
    is then the one place its packages can be found."""
    installed = {os.path.realpath(p) for p in (*site.getsitepackages(), site.getusersitepackages())}
    return run_dir if os.path.realpath(PACKAGES_ROOT) in installed else PACKAGES_ROOT


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Child:
    role: str
    rank: int
    dp_rank: int
    proc: subprocess.Popen
    sentinel: int
    """A pidfd: readable once the process has exited."""
    name: str

    @classmethod
    def start(
        cls, role: str, rank: int, dp_rank: int, args_file: str, run_dir: str, dp_size: int, env: dict[str, str]
    ) -> Child:
        cmd = [sys.executable, "-m", MODULE_OF_ROLE[role], "--args-file", args_file]
        cmd += ["--parent-pid", str(os.getpid()), "--rank", str(rank), "--dp-rank", str(dp_rank)]
        proc = subprocess.Popen(cmd, cwd=child_cwd(run_dir), env={**CHILD_ENV_DEFAULTS, **os.environ, **env})
        return cls(role, rank, dp_rank, proc, os.pidfd_open(proc.pid), process_name(role, rank, dp_rank, dp_size))

    def wait_or_kill(self, timeout: float) -> None:
        """Waits up to `timeout` for the child to exit, then SIGKILLs it."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
