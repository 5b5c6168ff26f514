"""Entry point of a worker rank: `python -m gpu_worker --args-file F --parent-pid P --rank R`."""

from __future__ import annotations

import logging
import sys

from wire.child import start_child


def main() -> None:
    ctx = start_child("worker")
    try:
        from gpu_worker.worker import Worker

        worker = Worker(ctx)
    except Exception as e:
        logging.getLogger(__name__).exception("worker failed to start")
        ctx.report_failed(f"worker[tp{ctx.rank}] could not start: {type(e).__name__}: {e}")
        sys.exit(1)
    ctx.report_ready(f"{worker.num_pages - 1} KV pages of {ctx.args.page_size} tokens, {worker.dtype}")
    worker.run_forever()


if __name__ == "__main__":
    main()
