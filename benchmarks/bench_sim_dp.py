"""Data parallelism at a size no machine here can run with the model: `--dp-size 16` with
simulated workers, one tokenizer in front of 16 schedulers.

For each load-balance method: start the server, send `--requests` requests at once with
output lengths spread over `--output-len` (so replicas finish at different times), sample
every replica's open requests while they run, and report what the tokenizer routed where
(/server_info `replicas`). What each method promises (tokenizer_proc/router.py):

- round_robin: routed counts differ by at most one;
- shortest_queue: open requests stay level across replicas as requests finish;
- longest_prefix: requests sharing a prompt prefix land on one replica (up to the
  imbalance limit), so the prefix cache hits.

    python benchmarks/bench_sim_dp.py --dp-size 16 --output-json benchmarks/results/sim_dp16.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import threading
import time
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sim_scale import RESULTS  # noqa: E402
from launched_server import REPO_ROOT, LaunchedServer  # noqa: E402
from serving_report import write_json  # noqa: E402

METHODS = ("round_robin", "shortest_queue", "longest_prefix")


def bodies(n: int, output_len: tuple[int, int], groups: int, seed: int) -> list[dict[str, Any]]:
    """Requests in `groups` families that share a 64-token prefix (what longest_prefix keys on)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000, 30000) for _ in range(64)] for _ in range(groups)]
    out = []
    for i in range(n):
        ids = prefixes[i % groups] + [rng.randrange(1000, 30000) for _ in range(16)]
        params = {"max_new_tokens": rng.randint(*output_len), "temperature": 0, "ignore_eos": True}
        out.append({"rid": f"dp-{i}", "input_ids": ids, "sampling_params": params})
    return out


async def send_collect(base_url: str, requests: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    """POST /generate for every request at once; each response's meta_info (None if it failed)."""
    limits = httpx.Limits(max_connections=len(requests), max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(3600), limits=limits) as client:

        async def one(body: dict[str, Any]) -> dict[str, Any] | None:
            try:
                r = await client.post("/generate", json=body)
            except httpx.HTTPError:
                return None
            return r.json()["meta_info"] if r.status_code == 200 else None

        return list(await asyncio.gather(*(one(b) for b in requests)))


def family_replicas(http: httpx.Client, ns: argparse.Namespace) -> dict[int, list[int]]:
    """After the load: `--probes-per-family` more requests of each prompt family, one at a
    time, each attributed to the replica whose routed count it raised. longest_prefix
    promises one replica per family."""
    probes = bodies(ns.probes_per_family * ns.groups, (1, 1), ns.groups, ns.seed)
    seen: dict[int, list[int]] = {}
    for i, body in enumerate(probes):
        before = [r["routed_requests"] for r in http.get("/server_info").json()["replicas"]]
        body["rid"] = f"probe-{i}"
        http.post("/generate", json=body).raise_for_status()
        after = [r["routed_requests"] for r in http.get("/server_info").json()["replicas"]]
        seen.setdefault(i % ns.groups, []).extend(d for d in range(len(after)) if after[d] > before[d])
    return seen


def run_method(method: str, ns: argparse.Namespace) -> dict[str, Any]:
    launch = [sys.executable, "launch.py", "--worker", "simulated", "--sim-profile", ns.profile]
    launch += ["--dp-size", str(ns.dp_size), "--load-balance-method", method, *shlex.split(ns.launch_args)]
    log = os.path.join(RESULTS, f"sim-dp{ns.dp_size}-{method}-{time.strftime('%Y%m%d-%H%M%S')}.log")
    requests = bodies(ns.requests, ns.output_len, ns.groups, ns.seed)
    spread: list[int] = []  # max - min open requests across replicas, sampled while running
    with (
        LaunchedServer(shlex.join(launch), log, timeout_s=900) as server,
        httpx.Client(base_url=server.base_url, timeout=60) as http,
    ):
        metas: list[dict[str, Any] | None] = []
        sender = threading.Thread(target=lambda: metas.extend(asyncio.run(send_collect(server.base_url, requests))))
        t0 = time.monotonic()
        sender.start()
        while sender.is_alive():
            replicas = http.get("/server_info").json()["replicas"]
            opened = [r["open_requests"] for r in replicas]
            if sum(opened):
                spread.append(max(opened) - min(opened))
            sender.join(0.2)
        wall = time.monotonic() - t0
        replicas = http.get("/server_info").json()["replicas"]
        affinity = family_replicas(http, ns)
    routed = [r["routed_requests"] for r in replicas]
    done = [m for m in metas if m is not None]
    result = {
        "method": method,
        "completed": len(done),
        "failed": len(metas) - len(done),
        "wall_s": wall,
        "routed_per_replica": routed,
        "routed_max_minus_min": max(routed) - min(routed),
        "open_spread_median": sorted(spread)[len(spread) // 2] if spread else 0,
        "open_spread_max": max(spread) if spread else 0,
        "prompt_tokens_from_prefix_cache": sum(m["cached_tokens"] for m in done)
        / sum(m["prompt_tokens"] for m in done),
        "replicas_per_family": affinity,
        "families_on_one_replica": sum(len(set(r)) == 1 for r in affinity.values()),
    }
    print(json.dumps(result), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp-size", type=int, default=16)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--profile", default=os.path.join(REPO_ROOT, "trident", "profiles", "h100-llama3.1-8b-bf16.json"))
    p.add_argument("--requests", type=int, default=640)
    p.add_argument("--output-len", type=lambda s: tuple(map(int, s.split("-"))), default=(8, 256))
    p.add_argument("--groups", type=int, default=8, help="prompt families sharing a prefix")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--probes-per-family", type=int, default=4, help="after the load, to see where families go")
    p.add_argument("--launch-args", default="", help="extra launch.py flags")
    p.add_argument("--output-json", default=None)
    ns = p.parse_args(argv)
    doc = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "dp_size": ns.dp_size, "requests": ns.requests}
    doc["runs"] = [run_method(m, ns) for m in ns.methods.split(",")]
    if ns.output_json:
        write_json(doc, ns.output_json)
    return 0 if all(r["failed"] == 0 for r in doc["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
