"""Entry point of the scheduler: `python -m scheduler_proc --args-file F --parent-pid P`."""

from __future__ import annotations

import gc
import logging
import signal
import sys

from wire.child import start_child

logger = logging.getLogger("scheduler_proc")

GC_GEN0_THRESHOLD = 50_000
"""A decode step allocates a few container objects per running request (its TokenOut, its
page append); at Python's default of 700 the cyclic collector ran several times a step and
took half of the scheduler's CPU at 256 running requests (docs/benchmarks.md, simulation
section). The scheduler's own structures have few cycles (radix-tree parent links), so
collecting rarely costs little memory."""


def main() -> None:
    ctx = start_child("scheduler")
    from scheduler_proc.scheduler import Scheduler

    try:
        scheduler = Scheduler(ctx)
    except Exception as e:
        logger.exception("scheduler failed to start")
        ctx.report_failed(f"scheduler could not start: {type(e).__name__}: {e}")
        sys.exit(1)
    # What start-up allocated (modules, the tokenizer-independent tables) is never garbage:
    # keep the collector from walking it again, and let it run every ~50k allocations.
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, 50, 100)
    ctx.report_ready(f"KV pool {scheduler.kv.total_tokens} tokens, page size {scheduler.kv.page_size}")

    def on_sigterm(_signum, _frame) -> None:
        if scheduler.io.recorder is not None:
            scheduler.io.recorder.flush()  # a recording must survive a normal stop
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        scheduler.run()
    except Exception:
        logger.exception("scheduler loop crashed")
        sys.exit(1)


if __name__ == "__main__":
    main()
