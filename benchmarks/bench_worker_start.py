"""How long a worker takes to build its model: `Worker(...)` in this process, as the worker's
main builds it from ServerArgs (GGUF read, dequantize or repack, kernels, KV pool).

    python benchmarks/bench_worker_start.py --models smollm2-135m,gemma-3-270m --dtypes float32,auto --repeats 2

One JSON line per (model, dtype, repeat): wall and CPU seconds, and the process's peak
resident memory so far (a high-water mark: the first line's is that load's peak). torch's
import and the kernels' first build are not in it (both happen before the first
measurement). Run it with the environment the launcher gives a worker (CHILD_ENV_DEFAULTS,
set here unless the caller set them) so the numbers are a served worker's.
"""

from __future__ import annotations

import os

from trident.child_process import CHILD_ENV_DEFAULTS

for key, value in CHILD_ENV_DEFAULTS.items():  # before numpy is imported
    os.environ.setdefault(key, value)

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2-135m,gemma-3-270m", help="packaged names or paths, comma-separated")
    p.add_argument("--dtypes", default="float32,auto", help="--dtype values, comma-separated")
    p.add_argument("--repeats", type=int, default=2)
    ns = p.parse_args()

    from gpu_worker.runtime.worker import Worker
    from trident.model_source import resolve_model
    from trident.wire.child import ChildContext
    from trident.wire.server_args import ServerArgs

    for model in ns.models.split(","):
        path, name = resolve_model(model)
        for dtype in ns.dtypes.split(","):
            for repeat in range(ns.repeats):
                args = ServerArgs(model_path=path, dtype=dtype, max_total_tokens=16384, run_dir=tempfile.mkdtemp())
                ctx = ChildContext(args, "worker", 0)
                wall, cpu = time.perf_counter(), time.process_time()
                worker = Worker(ctx)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                print(
                    json.dumps(
                        {
                            "model": name,
                            "dtype": dtype,
                            "repeat": repeat,
                            "wall_s": round(wall, 2),
                            "cpu_s": round(cpu, 2),
                            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
                            "summary": worker.summary(),
                        }
                    ),
                    flush=True,
                )
                ctx.zmq_ctx.destroy(linger=0)
                del worker


if __name__ == "__main__":
    main()
