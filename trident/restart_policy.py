"""When to restart a dead process, how long to wait first, and when to give up.

A crash loop and a fault look alike at the moment of death; they differ in what came
before it. A process that dies before it reports ready, or soon after, is failing to come
up: restarting it at once would only repeat the failure, so it waits (exponentially longer
each time, capped) and counts against the budget (`max_restarts` within
`restart_window_s`). A process that served for a while and then died (SIGKILL, OOM, a
lost node) had a fault: it is restarted at once, costs no budget, and its backoff starts
over.

    spawn ----> ready --- SETTLE_S --->  stable
      |           |                        |
      +-- dies ---+-- dies: quick failure  +-- dies: fault
          (counted, backoff doubles)           (not counted, restarted at once)

Units are what the supervisor restarts as one: a replica's worker group, a replica's
scheduler, the tokenizer. Pure bookkeeping: the clock is injected, nothing is spawned here.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

SETTLE_S = 10.0
"""A process ready for this long has come up: its death is a fault, not a crash loop."""
BACKOFF_FIRST_S = 0.5
"""Wait before the restart that follows the first quick failure; doubles with each more."""
BACKOFF_CAP_S = 30.0

Unit = tuple[str, int]
"""(role, dp_rank): ("worker", d) is replica d's whole TP group; the tokenizer is ("tokenizer", 0)."""


@dataclass
class UnitLife:
    started_at: float
    ready_at: float | None = None
    quick_failures: int = 0
    """Consecutive deaths before or soon after ready; 0 once a start held for SETTLE_S."""


@dataclass(frozen=True)
class RestartDecision:
    restart: bool
    """False: the budget is spent; give up."""
    delay_s: float
    """Wait this long before starting the unit again."""
    counted: bool
    """Whether this death counted against the budget (a quick failure)."""
    why: str
    """For the log: fault or quick failure, and the budget used."""


class RestartPolicy:
    def __init__(self, max_restarts: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.clock = clock
        self.lives: dict[Unit, UnitLife] = {}
        self.counted_at: deque[float] = deque()
        """When each counted restart happened, the last window's worth."""
        self.restarts = 0
        """Every restart decided since launch, counted or not (for /metrics)."""

    def started(self, unit: Unit) -> None:
        life = self.lives.get(unit)
        failures = life.quick_failures if life else 0
        self.lives[unit] = UnitLife(self.clock(), quick_failures=failures)

    def ready(self, unit: Unit) -> None:
        life = self.lives.get(unit)
        if life is not None and life.ready_at is None:
            life.ready_at = self.clock()

    def on_death(self, unit: Unit) -> RestartDecision:
        """Decides what a death of `unit` costs. Call `started` when it is spawned again."""
        now = self.clock()
        life = self.lives.get(unit) or UnitLife(now)
        quick = life.ready_at is None or now - life.ready_at < SETTLE_S
        life.quick_failures = life.quick_failures + 1 if quick else 0
        self.lives[unit] = life
        self.restarts += 1
        if not quick:
            return RestartDecision(True, 0.0, False, f"a fault after {now - life.ready_at:.0f} s of service")
        self.counted_at.append(now)
        while self.counted_at and now - self.counted_at[0] > self.window_s:
            self.counted_at.popleft()
        used = len(self.counted_at)
        phase = "before it was ready" if life.ready_at is None else f"{now - life.ready_at:.1f} s after ready"
        why = f"died {phase}: quick failure {used} of {self.max_restarts} allowed within {self.window_s:.0f} s"
        if used > self.max_restarts:
            return RestartDecision(False, 0.0, True, why)
        delay = min(BACKOFF_CAP_S, BACKOFF_FIRST_S * 2 ** (life.quick_failures - 1))
        return RestartDecision(True, delay, True, why)
