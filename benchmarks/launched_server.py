"""A trident server started for a benchmark on a free port, and stopped after it."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import psutil

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

READY_MARKER = "trident ready:"


def child_process(root_pid: int, title: str) -> psutil.Process:
    """The process under `root_pid` whose title (setproctitle) is `title`, e.g. "trident::scheduler"."""
    for p in psutil.Process(root_pid).children(recursive=True):
        if " ".join(p.cmdline()).strip() == title:
            return p
    raise RuntimeError(f"no {title} under pid {root_pid}")


def cpu_seconds(p: psutil.Process) -> float:
    """User + system CPU time of every thread of `p`."""
    t = p.cpu_times()
    return t.user + t.system


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LaunchedServer:
    """`python launch.py ...` on a free port: wait for 'trident ready:', stop with SIGTERM then SIGKILL.


    Its stdout/stderr go to `log_path`. Use as a context manager.
    """

    def __init__(self, command: str, log_path: str, timeout_s: float = 600.0, cwd: str = REPO_ROOT) -> None:
        self.argv = shlex.split(command)
        self.cwd = cwd
        if "--port" not in self.argv:
            self.argv += ["--port", str(free_port())]
        self.port = int(self.argv[self.argv.index("--port") + 1])
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self.ready = threading.Event()
        self._log: Any = None

    def __enter__(self) -> LaunchedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _pump(self, log: Any) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            log.write(line)
            log.flush()
            if line.startswith(READY_MARKER):
                self.base_url = line.split()[2].rstrip("/")
                self.ready.set()

    def start(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        log = self._log = open(self.log_path, "w")  # closed in stop()
        print(f"starting in {self.cwd}: {shlex.join(self.argv)} (log: {self.log_path})", file=sys.stderr, flush=True)
        self.proc = subprocess.Popen(
            self.argv, cwd=self.cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        threading.Thread(target=self._pump, args=(log,), daemon=True).start()
        t0 = time.monotonic()
        while not self.ready.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() - t0 > self.timeout_s:
                self.stop()
                raise RuntimeError(f"server did not become ready (exit {self.proc.returncode}); see {self.log_path}")
        print(
            f"server ready in {time.monotonic() - t0:.1f} s at {self.base_url} (pid {self.proc.pid})",
            file=sys.stderr,
            flush=True,
        )

    def stop(self, grace_s: float = 30.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the launcher and its children
                self.proc.wait()
        if self._log is not None:
            self._log.close()
