"""CPU seconds that one server start costs, per process: the launcher, the tokenizer, the
scheduler and each worker, from `python launch.py` to the first completion answered.

    python benchmarks/bench_server_start.py --model smollm2-135m --repeats 3
    python benchmarks/bench_server_start.py --model smollm2-135m --trees /work/main,. --repeats 3

Each start: launch, wait for the ready line, send one short completion, read every process's
user + system CPU from /proc, stop. `--trees` alternates the same starts between source trees
(each run with its own PYTHONPATH), so two versions are compared under the same load. One JSON
line per start, then the median of each process per tree. The test suite starts a server
many times, and most of a tiny model's start is imports, so these figures are most of its
CPU too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import httpx
import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launched_server import LaunchedServer, cpu_seconds  # noqa: E402


def start_cpu(tree: str, model: str, extra: str) -> dict[str, float]:
    """One start, one completion, stop: {process title: CPU seconds}, plus the ready wall time."""
    command = f"{sys.executable} {os.path.join(tree, 'launch.py')} --model {model} {extra}"
    env_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = tree  # the launcher and every child import this tree
    try:
        with tempfile.NamedTemporaryFile(suffix=".log") as log, LaunchedServer(command, log.name, cwd=tree) as server:
            with httpx.Client(base_url=server.base_url, timeout=120) as http:
                served = http.get("/v1/models").json()["data"][0]["id"]
                one = {"model": served, "prompt": "Hello", "max_tokens": 4}
                http.post("/v1/completions", json=one).raise_for_status()
            assert server.proc is not None
            root = psutil.Process(server.proc.pid)
            cpu = {"launcher": cpu_seconds(root)}
            for child in root.children(recursive=True):
                title = " ".join(child.cmdline()).strip() or child.name()
                cpu[title] = cpu.get(title, 0.0) + cpu_seconds(child)
    finally:
        if env_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = env_path
    cpu["total"] = sum(cpu.values())
    return {k: round(v, 2) for k, v in cpu.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="packaged name or path, as --model takes it")
    p.add_argument("--trees", default=".", help="source trees to compare, comma-separated (alternated)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--extra", default="", help="more launch.py flags, one string")
    ns = p.parse_args()

    trees = [os.path.abspath(t) for t in ns.trees.split(",")]
    runs: dict[str, list[dict[str, float]]] = {t: [] for t in trees}
    for repeat in range(ns.repeats):
        for tree in trees:
            cpu = start_cpu(tree, ns.model, ns.extra)
            runs[tree].append(cpu)
            print(json.dumps({"tree": tree, "repeat": repeat, "cpu_s": cpu}), flush=True)
    for tree, cpus in runs.items():
        median = {k: round(statistics.median(c.get(k, 0.0) for c in cpus), 2) for k in cpus[0]}
        print(json.dumps({"tree": tree, "model": ns.model, "median_cpu_s": median}), flush=True)


if __name__ == "__main__":
    main()
