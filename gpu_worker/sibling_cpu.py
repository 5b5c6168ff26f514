"""CPU time the server's other processes spend: what a simulated worker's steps are stretched by.

A model worker on a CPU shares its cores with the tokenizer and the scheduler (and the
launcher): every moment they run during a step, one of the worker's threads waits, and its
teammates wait for it at the next barrier. A simulated worker only sleeps, so the same
front end runs on idle cores and the step loses nothing. `SiblingCpu` reads, at a step's
start and end, how much CPU those processes used in between; `Contention` turns that into
the time the real worker would have lost (simulated.py adds it to the step).

The processes are those under launch.py (this worker's parent) that are not workers, and
launch.py itself. Each is read through its process CPU clock (clock_gettime on the clock id
Linux derives from a pid): all its threads, in nanoseconds, one system call, where
/proc/<pid>/stat counts in 10 ms ticks, coarser than a decode step.
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
"""How often the list of processes is read again: a restarted tokenizer or scheduler has a new pid."""
_CPUCLOCK_SCHED = 2


def process_cpu_clock(pid: int) -> int:
    """The clock id of process `pid`'s CPU time, as glibc's clock_getcpuclockid builds it."""
    return ((~pid) << 3) | _CPUCLOCK_SCHED


def _is_worker(p: psutil.Process) -> bool:
    try:
        return " ".join(p.cmdline()).startswith(WORKER_TITLE)
    except psutil.Error:
        return True  # gone or unreadable: nothing to count


def front_end_pids(launcher_pid: int, own_pid: int) -> list[int]:
    """launch.py and every process under it that is neither a worker nor this one."""
    try:
        children = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.Error:
        return []
    return [launcher_pid] + [p.pid for p in children if p.pid != own_pid and not _is_worker(p)]


class SiblingCpu:
    """CPU seconds a set of processes (found by `find`, read again every REFRESH_S) used since
    the last `mark()`."""

    def __init__(self, find: Callable[[], list[int]] | None = None) -> None:
        """`find`: returns the pids to count; default: the front end of this worker's server."""
        self._find = find or (lambda: front_end_pids(os.getppid(), os.getpid()))
        self._pids: list[int] = []
        self._found_at = -REFRESH_S
        self._marked: dict[int, float] = {}

    def _read(self) -> dict[int, float]:
        used = {}
        for pid in self._pids:
            try:
                used[pid] = time.clock_gettime(process_cpu_clock(pid))
            except OSError:  # exited since the list was read: look again next time
                self._found_at = -REFRESH_S
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
    """How much of the front end's CPU a real worker's step would have lost, from the host
    the profile was measured on.

    With as many worker threads as cores, every CPU second the front end runs during a step
    displaces a worker thread for that second, and the step (whose threads meet at barriers)
    ends that much later. With fewer threads than cores, the front end first fills the
    cores the worker leaves idle. What it assumes: the front end costs the same CPU on the
    simulating host as it would beside the real worker, and a displaced thread costs the
    step its own time and no more (no cache refill, no wake-up latency)."""

    worker_threads: int
    host_cores: int

    def lost_seconds(self, front_end_cpu_s: float, step_s: float) -> float:
        """Seconds a step of `step_s` loses to `front_end_cpu_s` of front-end CPU within it."""
        idle_cores = max(0, self.host_cores - self.worker_threads)
        return max(0.0, front_end_cpu_s - idle_cores * step_s)
