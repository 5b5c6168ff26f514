"""Entry point of the scheduler: `python -m scheduler_proc --args-file F --parent-pid P`."""

from __future__ import annotations

import logging
import signal
import sys

from trident.wire.child import start_child, tune_gc

logger = logging.getLogger("scheduler_proc")


def main() -> None:
    ctx = start_child("scheduler")
    from scheduler_proc.scheduler import Scheduler

    try:
        scheduler = Scheduler(ctx)
    except Exception as e:
        logger.exception("scheduler failed to start")
        ctx.report_failed(f"scheduler could not start: {type(e).__name__}: {e}")
        sys.exit(1)
    tune_gc()
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
