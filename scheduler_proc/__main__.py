"""Entry point of the scheduler: `python -m scheduler_proc --args-file F --parent-pid P`."""

from __future__ import annotations

import logging
import sys

from wire.child import start_child

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
    ctx.report_ready(f"KV pool {scheduler.kv.total_tokens} tokens, page size {scheduler.kv.page_size}")
    try:
        scheduler.run()
    except Exception:
        logger.exception("scheduler loop crashed")
        sys.exit(1)


if __name__ == "__main__":
    main()
