"""CPU time the rest of the host spends: what a simulated worker's steps are stretched by.

A model worker on a CPU shares its cores with the tokenizer and the scheduler (and the
launcher), and with whatever else runs on the host, a benchmark's client first of all:
every moment they run during a step, one of the worker's threads waits, and its teammates
wait for it at the next barrier. A simulated worker only sleeps, so the same processes run
on idle cores and the step loses nothing. `SiblingCpu` reads, at a step's start and end,
how much CPU those processes used in between; `Contention` turns that into the time the
real worker would have lost (simulated.py adds it to the step).

The processes are every process on the host but the server's workers (`host_pids`): the
front end, and the client that streams its tokens (bench_frontend_cpu.py measures both,
docs/benchmarks.md), which the real worker it is compared with shares its cores with.
Each is read through its process CPU clock (clock_gettime on the clock id Linux derives
from a pid): all its threads, in nanoseconds, one system call, where /proc/<pid>/stat
counts in 10 ms ticks, coarser than a decode step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

WORKER_TITLE = "trident::worker"
"""Titles of worker processes start with this (trident/wire/control.py process_name)."""
REFRESH_S = 2.0
"""How often the list of processes is read again: a restarted tokenizer or scheduler, or a
new client, has a new pid."""
_CPUCLOCK_SCHED = 2


def process_cpu_clock(pid: int) -> int:
    """The clock id of process `pid`'s CPU time, as glibc's clock_getcpuclockid builds it."""
    return ((~pid) << 3) | _CPUCLOCK_SCHED


def _is_worker(p: psutil.Process) -> bool:
    try:
        return " ".join(p.cmdline()).startswith(WORKER_TITLE)
    except psutil.Error:
        return True  # gone or unreadable: nothing to count


def host_pids(launcher_pid: int, own_pid: int) -> list[int]:
    """Every process on the host but this one and the other workers under launch.py (a
    simulated worker's CPU is its own bookkeeping, not a model's)."""
    try:
        workers = {p.pid for p in psutil.Process(launcher_pid).children(recursive=True) if _is_worker(p)}
    except psutil.Error:
        workers = set()
    return [pid for pid in psutil.pids() if pid != own_pid and pid not in workers]


class SiblingCpu:
    """CPU seconds a set of processes (found by `find`, read again every REFRESH_S) used since
    the last `mark()`."""

    def __init__(self, find: Callable[[], list[int]] | None = None) -> None:
        """`find`: returns the pids to count; default: the host's but this server's workers."""
        self._find = find or (lambda: host_pids(os.getppid(), os.getpid()))
        self._pids: list[int] = []
        self._found_at = -REFRESH_S
        self._marked: dict[int, float] = {}

    def _read(self) -> dict[int, float]:
        used, gone = {}, []
        for pid in self._pids:
            try:
                used[pid] = time.clock_gettime(process_cpu_clock(pid))
            except OSError:  # exited since the list was read (a restart's new pid comes with the next list)
                gone.append(pid)
        if gone:
            self._pids = [pid for pid in self._pids if pid not in gone]
        return used

    def mark(self) -> None:
        now = time.monotonic()
        if now - self._found_at >= REFRESH_S:
            self._pids, self._found_at = self._find(), now
        self._marked = self._read()

    def since_mark(self) -> float:
        """CPU seconds, all threads of every process, since `mark()`; a process that started
        or exited in between is left out (a restart loses that step's share, no more)."""
        now = self._read()
        return sum(now[pid] - self._marked[pid] for pid in now.keys() & self._marked.keys())


@dataclass(frozen=True)
class Contention:
    """How much of the CPU other processes used during a step (the front end's, a client's) a
    real worker's step would have lost, from the host the profile was measured on.

    They first fill what the worker leaves idle: the cores beyond its threads, and the
    core-time its own threads sleep in the step, waiting at barriers or for a serial part
    (StepProfile.idle_core_seconds). Past that, every CPU second they run displaces a
    worker thread for that second, and the step (whose threads meet at barriers) ends that
    much later. What it assumes: they cost the same CPU on the simulating host as they would
    beside the real worker, and a displaced thread costs the step its own time and no more
    (no cache refill, no wake-up latency; docs/benchmarks.md has it measured with a
    process burning CPU in bursts beside the swept worker)."""

    worker_threads: int
    host_cores: int

    def lost_seconds(self, others_cpu_s: float, step_s: float, worker_idle_core_s: float = 0.0) -> float:
        """Seconds a step of `step_s` loses to `others_cpu_s` of other processes' CPU within
        it, where the worker's threads leave `worker_idle_core_s` of their cores' time idle."""
        idle_cores = max(0, self.host_cores - self.worker_threads)
        return max(0.0, others_cpu_s - idle_cores * step_s - worker_idle_core_s)
