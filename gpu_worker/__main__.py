"""Entry point of a worker rank: `python -m gpu_worker --args-file F --parent-pid P --rank R`."""

from __future__ import annotations

import logging
import os
import sys

from gpu_worker.runtime.malloc_policy import keep_freed_memory
from gpu_worker.runtime.omp_policy import use_passive_omp_wait
from trident.wire.child import start_child


def main() -> None:
    use_passive_omp_wait()
    keep_freed_memory()
    ctx = start_child("worker")
    try:
        if ctx.args.worker == "simulated":
            from gpu_worker.sim.simulated import SimulatedWorker

            worker = SimulatedWorker(ctx)
        else:
            from gpu_worker.runtime.worker import Worker

            worker = Worker(ctx)
    except Exception as e:
        logging.getLogger(__name__).exception("worker failed to start")
        ctx.report_failed(f"{ctx.name} could not start: {type(e).__name__}: {e}")
        sys.exit(1)
    ctx.report_ready(f"{worker.num_pages - 1} KV pages of {ctx.args.page_size} tokens, {worker.summary()}")
    try:
        worker.run_forever()
    except Exception as e:  # e.g. a tensor-parallel peer died or a collective timed out
        logging.getLogger(__name__).exception("worker stopped")
        ctx.report_failed(f"{ctx.name} stopped: {type(e).__name__}: {e}")
        os._exit(1)  # no process-group teardown: the supervisor restarts the whole group


if __name__ == "__main__":
    main()
