"""Starting, supervising, restarting and stopping trident's processes (used by launch.py).

Supervision waits on process sentinels (pidfds) and on the control socket together; it
never polls with sleeps. What a death costs:

    worker (any rank) dies, or the scheduler reports it hung
        -> SIGKILL the whole TP group, start it again; the scheduler requeues its running
           requests as prefills of prompt + output (WorkerGroupLost tells it, unless it asked)
    scheduler dies -> start it again; it resets the workers' batches and announces a new
           boot_id, and the tokenizer resubmits the requests it still holds
    tokenizer dies -> start it again; its HTTP connections are lost, the scheduler frees
           their work when the new tokenizer says hello

More than `max_restarts` restarts within `restart_window_s` stop the restarting: the
tokenizer is told the server is unhealthy and answers 503 from then on.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass

import zmq

from wire.control import LauncherMessage, ProcessFailed, ProcessReady, RestartWorkers, check_protocol_version
from wire.frontend import ServerHealth, WorkerGroupLost
from wire.server_args import ServerArgs
from wire.transport import (
    ENDPOINT_LAUNCHER,
    ENDPOINT_SCHEDULER_IN,
    ENDPOINT_TOKENIZER_IN,
    PullSocket,
    PushSocket,
    endpoint,
)

logger = logging.getLogger("trident.launch")
REPO_ROOT = os.path.dirname(os.path.abspath(__file__))
STOP_GRACE_S = 5.0
MODULE_OF_ROLE = {"worker": "gpu_worker", "scheduler": "scheduler_proc", "tokenizer": "tokenizer_proc"}
DIST_PORT_ENV = "TRIDENT_DIST_INIT_PORT"
"""The worker group's torch.distributed rendezvous port, fresh for every generation."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Child:
    role: str
    rank: int
    proc: subprocess.Popen
    sentinel: int
    """A pidfd: readable once the process has exited."""

    @property
    def name(self) -> str:
        return f"worker[tp{self.rank}]" if self.role == "worker" else self.role


class StartupError(RuntimeError):
    pass


class Launcher:
    """Owns the children of one server; the run directory belongs to the caller."""

    def __init__(self, args: ServerArgs, args_file: str) -> None:
        self.args = args
        self.args_file = args_file
        self.children: list[Child] = []
        self.zmq_ctx = zmq.Context()
        run = args.run_dir
        self.control = PullSocket(self.zmq_ctx, endpoint(run, ENDPOINT_LAUNCHER), True, LauncherMessage, "launcher")
        self.to_scheduler = PushSocket(self.zmq_ctx, endpoint(run, ENDPOINT_SCHEDULER_IN), bind=False)
        self.to_tokenizer: PushSocket | None = None
        self.restart_times: deque[float] = deque()
        self.restarts = 0
        self.healthy = True
        self.worker_generations = 0

    # ------------------------------------------------------------------ start

    def spawn(self, role: str, rank: int = 0, env: dict[str, str] | None = None) -> Child:
        cmd = [
            sys.executable,
            "-m",
            MODULE_OF_ROLE[role],
            "--args-file",
            self.args_file,
            "--parent-pid",
            str(os.getpid()),
            "--rank",
            str(rank),
        ]
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])),
            **(env or {}),
        )
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env)
        child = Child(role, rank, proc, os.pidfd_open(proc.pid))
        self.children.append(child)
        return child

    def spawn_workers(self) -> None:
        """One process per TP rank. A group of several ranks rendezvous on a port chosen for
        this generation only, so a restarted group never meets the previous one's store."""
        env = {}
        if self.args.tp_size > 1:
            first = self.worker_generations == 0 and self.args.dist_init_port
            env[DIST_PORT_ENV] = str(self.args.dist_init_port if first else free_port())
        self.worker_generations += 1
        for rank in range(self.args.tp_size):
            self.spawn("worker", rank, env)

    def start_all(self, with_tokenizer: bool = True) -> None:
        self.spawn_workers()
        self.spawn("scheduler")
        self.wait_ready({("worker", r) for r in range(self.args.tp_size)} | {("scheduler", 0)})
        if with_tokenizer:
            self.spawn("tokenizer")
            self.wait_ready({("tokenizer", 0)})
            self.to_tokenizer = PushSocket(self.zmq_ctx, endpoint(self.args.run_dir, ENDPOINT_TOKENIZER_IN), False)

    def wait_ready(self, expected: set[tuple[str, int]]) -> None:
        deadline = time.monotonic() + self.args.startup_timeout_s
        while expected:
            for child in self.children:
                if child.proc.poll() is not None and (child.role, child.rank) in expected:
                    msg = self.control.recv(timeout_ms=500)  # a ProcessFailed may still be queued
                    if isinstance(msg, ProcessFailed):
                        raise StartupError(msg.error)
                    raise StartupError(f"{child.name} exited with code {child.proc.returncode} during start-up")
            if time.monotonic() > deadline:
                names = ", ".join(r + (f"[tp{k}]" if r == "worker" else "") for r, k in sorted(expected))
                raise StartupError(f"{names} did not report ready within {self.args.startup_timeout_s:.0f} s")
            msg = self.control.recv(timeout_ms=200)
            if isinstance(msg, ProcessFailed):
                raise StartupError(msg.error)
            if isinstance(msg, ProcessReady):
                self._log_ready(msg)
                expected.discard((msg.role, msg.rank))

    @staticmethod
    def _log_ready(msg: ProcessReady) -> None:
        check_protocol_version(msg.role, msg.protocol_version)
        name = msg.role + (f"[tp{msg.rank}]" if msg.role == "worker" else "")
        logger.info("%s ready (pid %d) %s", name, msg.pid, msg.detail)

    # ------------------------------------------------------------------ supervise

    def supervise(self, stop_requested) -> int:
        """Restarts what dies until a stop is requested; returns the exit code."""
        while not stop_requested():
            poller = zmq.Poller()
            poller.register(self.control.sock, zmq.POLLIN)
            for child in self.children:
                poller.register(child.sentinel, zmq.POLLIN)
            events = dict(poller.poll(500))
            if stop_requested():
                break  # children dying now are being stopped, not failing
            if self.control.sock in events:
                for msg in self.control.recv_nowait():
                    self._on_control(msg)
            for child in [c for c in self.children if c.sentinel in events]:
                if child in self.children and not self._on_death(child):
                    return 1
        return 0

    def _on_control(self, msg) -> None:
        if isinstance(msg, ProcessReady):
            self._log_ready(msg)
        elif isinstance(msg, ProcessFailed):
            logger.error("%s", msg.error)
        elif isinstance(msg, RestartWorkers):
            logger.error("scheduler asks for a worker restart: %s", msg.reason)
            self._restart_workers(msg.reason, scheduler_knows=True)

    def _on_death(self, child: Child) -> bool:
        """Handles an exited child; False when the server cannot go on."""
        child.proc.poll()
        cause = f"{child.name} (pid {child.proc.pid}) exited with code {child.proc.returncode}"
        logger.error("%s", cause)
        if child.role == "worker":
            self._restart_workers(cause, scheduler_knows=False)
        elif child.role == "scheduler":
            self._forget(child)
            if self._may_restart(cause):
                self.spawn("scheduler")
        else:
            self._forget(child)
            if not self._may_restart(cause):
                return False  # nothing is left to answer HTTP
            self.spawn("tokenizer")
        return True

    def _restart_workers(self, cause: str, scheduler_knows: bool) -> None:
        for child in [c for c in self.children if c.role == "worker"]:
            if child.proc.poll() is None:
                child.proc.kill()
            child.proc.wait()
            self._forget(child)
        if not self._may_restart(cause):
            return
        if not scheduler_knows:
            self.to_scheduler.send(WorkerGroupLost(cause))
        self.spawn_workers()

    def _may_restart(self, cause: str) -> bool:
        now = time.monotonic()
        self.restart_times.append(now)
        while self.restart_times and now - self.restart_times[0] > self.args.restart_window_s:
            self.restart_times.popleft()
        self.restarts += 1
        self.healthy = len(self.restart_times) <= self.args.max_restarts
        if not self.healthy:
            logger.error(
                "%d restarts within %.0f s: giving up; the server reports unhealthy",
                len(self.restart_times),
                self.args.restart_window_s,
            )
        else:
            logger.warning("restarting after: %s (restart %d)", cause, self.restarts)
        if self.to_tokenizer is not None:
            self.to_tokenizer.send(ServerHealth(self.healthy, self.restarts, cause))
        return self.healthy

    def _forget(self, child: Child) -> None:
        self.children.remove(child)
        os.close(child.sentinel)

    # ------------------------------------------------------------------ stop

    def stop_all(self) -> None:
        """The tokenizer first (it drains open requests), then everything else."""
        order = sorted(self.children, key=lambda c: c.role != "tokenizer")
        for child in order:
            if child.proc.poll() is None:
                child.proc.terminate()
            if child.role == "tokenizer":
                self._wait(child, self.args.shutdown_timeout_s + STOP_GRACE_S)
        deadline = time.monotonic() + STOP_GRACE_S
        for child in order:
            self._wait(child, max(0.0, deadline - time.monotonic()))
        for child in list(self.children):
            self._forget(child)
        for sock in (self.control, self.to_scheduler, self.to_tokenizer):
            if sock is not None:
                sock.close()
        self.zmq_ctx.term()

    @staticmethod
    def _wait(child: Child, timeout: float) -> None:
        try:
            child.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()
