"""The supervisor's restarts in flight: what each death costs (asked of restart_policy.py),
the restarts waiting out their backoff, and the give-up once the budget is spent.

Bookkeeping only: a unit starts through the callable the supervisor hands in with its death,
and the server's health goes out through `announce` (the supervisor's line to the tokenizer).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from trident.restart_policy import RestartPolicy, Unit

logger = logging.getLogger("trident.launch")
IDLE_POLL_MS = 500
"""The supervisor's longest wait with no backoff ending: node silence is checked as often."""


class RestartQueue:
    def __init__(self, policy: RestartPolicy, on_give_up: str, announce: Callable[[str], None]) -> None:
        self.policy = policy
        self.on_give_up = on_give_up
        """--on-give-up: "exit" or "stay" (only the log line says it here; the supervisor acts on it)."""
        self.announce = announce
        """Tells the tokenizer the server's health, naming this cause."""
        self.waiting: dict[Unit, tuple[float, Callable[[], None]]] = {}
        """Restarts waiting out their backoff: when each is due, and what starts it."""
        self.gave_up = False
        """The restart budget ran out: nothing is restarted any more."""

    def restart(self, unit: Unit, cause: str, start: Callable[[], None]) -> bool:
        """Starts `unit` again now or after its backoff, or gives up; False when it will not restart."""
        if self.gave_up:
            return False
        if unit in self.waiting:
            return True  # already waiting out its backoff
        decision = self.policy.on_death(unit)
        if not decision.restart:
            self._give_up(cause, decision.why)
            return False
        wait = f", in {decision.delay_s:.1f} s" if decision.delay_s else ""
        logger.warning("restarting after: %s (restart %d: %s%s)", cause, self.policy.restarts, decision.why, wait)
        self.announce(cause)
        if decision.delay_s:
            self.waiting[unit] = (time.monotonic() + decision.delay_s, start)
        else:
            start()
        return True

    def cancel(self, unit: Unit) -> None:
        """Drops `unit`'s restart if it is waiting (the supervisor starts it another way)."""
        self.waiting.pop(unit, None)

    def poll_ms(self) -> int:
        """How long the supervisor may wait: until the next backoff ends, at most IDLE_POLL_MS."""
        due = min((at for at, _ in self.waiting.values()), default=None)
        if due is None:
            return IDLE_POLL_MS
        return max(0, min(IDLE_POLL_MS, int((due - time.monotonic()) * 1000) + 1))

    def start_due(self) -> None:
        """Starts every unit whose backoff has ended."""
        now = time.monotonic()
        for unit, (at, start) in list(self.waiting.items()):
            if at <= now and not self.gave_up:
                del self.waiting[unit]
                start()

    def _give_up(self, cause: str, why: str) -> None:
        self.gave_up = True
        self.waiting.clear()
        then = "exiting" if self.on_give_up == "exit" else "staying up, answering 503"
        logger.error("giving up restarting after %s (%s); %s", cause, why, then)
        self.announce(f"gave up restarting after {cause} ({why})")
