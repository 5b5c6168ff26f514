"""Scale of one tokenizer + scheduler, measured against simulated workers.

One server (`launch.py --worker simulated --sim-profile P`, a large max-running-requests
and a KV pool of millions of tokens, which a simulated worker does not allocate) and:

1. sweep: for each running count N, N requests of `--prompt-len` tokens decode together;
   once all N run, the scheduler process's CPU time (user + system, /proc) over
   `--window` seconds is divided by the steps it made, and py-spy (if installed) samples
   where that CPU goes; then the N requests are aborted;
2. hold: `--hold` requests sent at once (10,000 by default) must all complete; the peak
   running and queued counts, wall time and scheduler CPU per step are reported;
3. rate ceiling: `--rate-requests` one-token requests, `--rate-concurrency` in flight:
   completed requests per second is the tokenizer's ceiling (the client shares the cores).

Example (the numbers in docs/benchmarks.md):

    python benchmarks/bench_sim_scale.py --profile h100-llama3.1-8b-bf16.json \\
        --label before --output-json benchmarks/results/sim_scale_before.json
    python benchmarks/bench_sim_scale.py --plot-json benchmarks/results/sim_scale_*.json \\
        --output-png docs/img/sim_scheduler_cost.png

Extra launch.py flags go after `--launch-args` (e.g. `--launch-args "--dp-size 16"` where
launch.py has it).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx
import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launched_server import REPO_ROOT, LaunchedServer, child_process, cpu_seconds  # noqa: E402
from serving_report import write_json  # noqa: E402

RESULTS = os.path.join(REPO_ROOT, "benchmarks", "results")
SCHEDULER_TITLE = "trident::scheduler"


def stats(http: httpx.Client) -> dict[str, Any]:
    return http.get("/server_info").json()["scheduler_stats"] or {}


def fresh_stats(http: httpx.Client, timeout_s: float = 5.0) -> dict[str, Any]:
    """Stats just published (every 0.5 s): waits for the step count to move, so that the
    CPU time read right after belongs to the same instant."""
    first = stats(http)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = stats(http)
        if now.get("steps") != first.get("steps"):
            return now
        time.sleep(0.01)
    return stats(http)


def main_thread_cpu_seconds(p: psutil.Process) -> float:
    """The Python thread's share of cpu_seconds (the rest is ZeroMQ's I/O thread and
    the parent-death watcher)."""
    for t in p.threads():
        if t.id == p.pid:
            return t.user_time + t.system_time
    return 0.0


def generate_body(rid: str, prompt_len: int, max_new: int) -> dict[str, Any]:
    ids = [1000 + (hash(rid) + k) % 30000 for k in range(prompt_len)]  # distinct prompts: no prefix sharing
    return {
        "rid": rid,
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
    }


async def send_all(base_url: str, bodies: list[dict[str, Any]], concurrency: int | None = None) -> list[int]:
    """POST /generate for every body; the status codes (599 for a transport error)."""
    limits = httpx.Limits(max_connections=concurrency or len(bodies), max_keepalive_connections=None)
    sem = asyncio.Semaphore(concurrency or len(bodies))
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(3600), limits=limits) as client:

        async def one(body: dict[str, Any]) -> int:
            async with sem:
                try:
                    return (await client.post("/generate", json=body)).status_code
                except httpx.HTTPError:
                    return 599

        return list(await asyncio.gather(*(one(b) for b in bodies)))


async def abort_all(base_url: str, rids: list[str], concurrency: int = 64) -> int:
    """POST /abort for every rid, `concurrency` at a time (one after another, 4,096 aborts
    took minutes while the tokenizer was busy streaming: each waited its turn on the
    tokenizer's event loop). Returns how many failed."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600), limits=limits) as client:

        async def one(rid: str) -> bool:
            async with sem:
                try:
                    return (await client.post("/abort", json={"rid": rid})).status_code < 500
                except httpx.HTTPError:
                    return False

        return sum(not ok for ok in await asyncio.gather(*(one(r) for r in rids)))


def py_spy_breakdown(pid: int, seconds: float) -> dict[str, float] | None:
    """Share of the scheduler's CPU samples inside each of its functions (inclusive)."""
    if shutil.which("py-spy") is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".txt") as out:
        cmd = [
            "py-spy",
            "record",
            "--pid",
            str(pid),
            "--duration",
            str(max(1, int(seconds))),
            "--rate",
            "200",
            "--format",
            "raw",
            "--nonblocking",
            "-o",
            out.name,
        ]
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            return None
        inclusive: collections.Counter[str] = collections.Counter()
        total = 0
        for line in open(out.name):
            stack, _, count = line.rstrip().rpartition(" ")
            n = int(count)
            total += n
            names = {
                f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0].split("/")[-1] + ")"
                for f in stack.split(";")
                if "scheduler_proc/" in f or "wire/" in f
            }
            for name in names:
                inclusive[name] += n
    return {k: round(v / total, 3) for k, v in inclusive.most_common(16)} if total else None


def sweep_point(server: LaunchedServer, http: httpx.Client, n: int, ns: argparse.Namespace) -> dict[str, Any]:
    rids = [f"sweep{n}-{i}" for i in range(n)]
    bodies = [generate_body(rid, ns.prompt_len, ns.max_new) for rid in rids]
    loop = asyncio.new_event_loop()
    task = loop.run_in_executor(None, lambda: asyncio.run(send_all(server.base_url, bodies)))
    # Wait until the N requests run with none queued; on a small host the tokenizer may pass
    # them on slower than the first ones finish, so settle for a count that stopped growing
    # (not before the first one runs: taking thousands of connections in takes the tokenizer
    # seconds).
    deadline = time.monotonic() + 300
    best, best_at = 0, time.monotonic()
    while (st := stats(http)).get("running_requests", 0) < n or st.get("queued_requests", 1) > 0:
        running = st.get("running_requests", 0)
        if running > best:
            best, best_at = running, time.monotonic()
        if (
            time.monotonic() > deadline
            or task.done()
            or (best > 0 and st.get("queued_requests", 1) == 0 and time.monotonic() - best_at > 15)
        ):
            break
        time.sleep(0.2)
    time.sleep(1.0)  # past the prefill steps
    sched = child_process(server.proc.pid, SCHEDULER_TITLE)
    s0, c0, m0, t0 = fresh_stats(http), cpu_seconds(sched), main_thread_cpu_seconds(sched), time.monotonic()
    breakdown = py_spy_breakdown(sched.pid, ns.window) if ns.py_spy else None
    if breakdown is None:
        time.sleep(ns.window)
    s1, c1, m1, t1 = fresh_stats(http), cpu_seconds(sched), main_thread_cpu_seconds(sched), time.monotonic()
    steps = s1["steps"] - s0["steps"]
    if steps <= 0:
        raise RuntimeError(f"no scheduler step in {t1 - t0:.1f} s with {n} requests: {s1}")
    point = {
        "running": n,
        "running_measured": (s0["running_requests"] + s1["running_requests"]) / 2,
        "steps": steps,
        "scheduler_cpu_ms_per_step": (c1 - c0) / steps * 1e3,
        "scheduler_main_thread_cpu_ms_per_step": (m1 - m0) / steps * 1e3,
        "loadavg_1min": os.getloadavg()[0],
        "step_ms": (t1 - t0) / steps * 1e3,
        "scheduler_cpu_share": (c1 - c0) / (t1 - t0),
        "tokens_per_s": (s1["generation_tokens"] - s0["generation_tokens"]) / (t1 - t0),
        "descriptor_bytes": s1["descriptor_bytes"],
        "py_spy_inclusive_share": breakdown,
    }
    print(json.dumps(point), flush=True)
    failed = asyncio.run(abort_all(server.base_url, rids))
    if failed:  # an overloaded tokenizer: those requests run to max_new instead
        print(f"{failed} of {len(rids)} aborts failed", file=sys.stderr)
    loop.run_until_complete(task)
    loop.close()
    return point


def hold(server: LaunchedServer, http: httpx.Client, ns: argparse.Namespace) -> dict[str, Any]:
    bodies = [generate_body(f"hold-{i}", ns.prompt_len, ns.hold_new_tokens) for i in range(ns.hold)]
    sched = child_process(server.proc.pid, SCHEDULER_TITLE)
    s0, c0, t0 = stats(http), cpu_seconds(sched), time.monotonic()
    peak = {"running": 0, "queued": 0}
    done: list[int] = []

    def run() -> None:
        done.extend(asyncio.run(send_all(server.base_url, bodies)))

    import threading

    th = threading.Thread(target=run)
    th.start()
    while th.is_alive():
        st = stats(http)
        peak["running"] = max(peak["running"], st.get("running_requests", 0))
        peak["queued"] = max(peak["queued"], st.get("queued_requests", 0))
        th.join(0.25)
    wall = time.monotonic() - t0
    s1, c1 = fresh_stats(http), cpu_seconds(sched)
    steps = s1["steps"] - s0["steps"]
    result = {
        "requests": ns.hold,
        "completed": sum(c == 200 for c in done),
        "failed": sum(c != 200 for c in done),
        "peak_running": peak["running"],
        "peak_queued": peak["queued"],
        "wall_s": wall,
        "scheduler_cpu_ms_per_step": (c1 - c0) / max(1, steps) * 1e3,
        "steps": steps,
    }
    print(json.dumps(result), flush=True)
    return result


def rate_ceiling(server: LaunchedServer, ns: argparse.Namespace) -> dict[str, Any]:
    bodies = [generate_body(f"rate-{i}", 8, 1) for i in range(ns.rate_requests)]
    t0 = time.monotonic()
    codes = asyncio.run(send_all(server.base_url, bodies, ns.rate_concurrency))
    wall = time.monotonic() - t0
    result = {
        "requests": len(bodies),
        "completed": codes.count(200),
        "concurrency": ns.rate_concurrency,
        "wall_s": wall,
        "requests_per_s": codes.count(200) / wall,
    }
    print(json.dumps(result), flush=True)
    return result


def write_png(docs: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for doc in docs:
        pts = doc["sweep"]
        ax.plot([p["running"] for p in pts], [p["scheduler_cpu_ms_per_step"] for p in pts], "o-", label=doc["label"])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("running requests (decoding together)")
    ax.set_ylabel("scheduler CPU per step (ms)")
    ax.set_title("Scheduler cost against running requests (simulated workers)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default=os.path.join(REPO_ROOT, "trident", "profiles", "h100-llama3.1-8b-bf16.json"))
    p.add_argument("--running", default="8,32,128,256,512,1024,2048,4096", help="running counts to sweep")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new", type=int, default=8000, help="sweep requests are aborted before this")
    p.add_argument("--window", type=float, default=4.0, help="seconds measured per running count")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument(
        "--kv-pool-tokens",
        type=int,
        default=20_000_000,
        help="simulated workers allocate no KV: a pool the sweep never fills (aborted requests stay cached)",
    )
    p.add_argument("--no-py-spy", dest="py_spy", action="store_false")
    p.add_argument("--hold", type=int, default=10_000, help="requests sent at once (0: skip)")
    p.add_argument("--hold-new-tokens", type=int, default=32)
    p.add_argument("--rate-requests", type=int, default=3000, help="one-token requests for the rate ceiling (0: skip)")
    p.add_argument("--rate-concurrency", type=int, default=256)
    p.add_argument("--launch-args", default="", help="extra launch.py flags")
    p.add_argument("--label", default="trident")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot-json", nargs="*", default=[], help="only plot these results")
    p.add_argument("--output-png", default=None)
    ns = p.parse_args(argv)
    if ns.plot_json:
        write_png([json.load(open(path)) for path in ns.plot_json], ns.output_png)
        return 0
    counts = [int(x) for x in ns.running.split(",")]
    max_running = max(counts)
    launch = [
        sys.executable,
        "launch.py",
        "--worker",
        "simulated",
        "--sim-profile",
        ns.profile,
        "--max-running-requests",
        str(max_running),
        "--max-total-tokens",
        str(ns.kv_pool_tokens),
        "--page-size",
        str(ns.page_size),
        "--max-queued-requests",
        str(2 * (ns.hold + max_running) + 1024),  # room for a sweep point's requests still being aborted
        "--watchdog-timeout",
        "600",
        *shlex.split(ns.launch_args),
    ]
    log = os.path.join(RESULTS, f"sim-scale-{ns.label}-{time.strftime('%Y%m%d-%H%M%S')}.log")
    doc: dict[str, Any] = {
        "label": ns.label,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "launch": launch,
        "profile": ns.profile,
        "loadavg_1min_before": os.getloadavg()[0],
    }
    with LaunchedServer(shlex.join(launch), log) as server, httpx.Client(base_url=server.base_url, timeout=60) as http:
        doc["sweep"] = [sweep_point(server, http, n, ns) for n in counts]
        doc["hold"] = hold(server, http, ns) if ns.hold else None
        doc["rate_ceiling"] = rate_ceiling(server, ns) if ns.rate_requests else None
    doc["loadavg_1min_after"] = os.getloadavg()[0]
    if ns.output_json:
        write_json(doc, ns.output_json)
    if ns.output_png:
        write_png([doc], ns.output_png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
