"""Time to first token of a lone short request, against the worker's own prefill time.

    python benchmarks/bench_ttft.py --dtype bfloat16 --requests 20

It starts trident with `--profile-steps` (the scheduler then logs every step's forward
time, as the worker measured it, and the time from sending the descriptor to getting
the result), sends `--requests` streaming completions one at a time (a few-token
prompt, one output token), and pairs each request's client-side TTFT with its prefill
step's log line. The difference is what the engine adds around the forward: HTTP,
tokenizing, two hops over ZeroMQ each way, scheduling, detokenizing and streaming.
Issue 8's goal: TTFT within 5 ms of the worker's prefill time. It also times the end of
each stream and a non-streamed one-token request (the same work, answered whole).

With `--extra "--worker simulated --sim-profile constant-1ms"` the forward is a
1 ms sleep, so what remains is the engine's own latency.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launched_server import REPO_ROOT, LaunchedServer  # noqa: E402

STEP_LINE = re.compile(r"step (\d+) mode 1 rows 1: .*sent->result ([\d.]+) ms = forward ([\d.]+) ms")


def first_token_time(client: httpx.Client, base_url: str, model: str, prompt: str) -> tuple[float, float]:
    """Seconds from sending the request to the first streamed text chunk, and to the stream's end."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", base_url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if first is None and line.startswith("data: ") and '"text"' in line:
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return first, time.perf_counter() - t0


def whole_response_time(client: httpx.Client, base_url: str, model: str, prompt: str) -> float:
    """Seconds for a non-streamed one-token completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    client.post(base_url + "/v1/completions", json=body).raise_for_status()
    return time.perf_counter() - t0


def prefill_steps(log_path: str, seen: int) -> list[tuple[float, float]]:
    """(sent->result ms, forward ms) of the single-row extend steps logged after the first `seen`."""
    with open(log_path) as f:
        found = [m for m in map(STEP_LINE.search, f) if m]
    return [(float(m.group(2)), float(m.group(3))) for m in found[seen:]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--extra", default="", help="more launch.py flags")
    p.add_argument("--output-json", default=None)
    ns = p.parse_args(argv)
    log = os.path.join(REPO_ROOT, "benchmarks", "results", f"ttft-{time.strftime('%Y%m%d-%H%M%S')}.log")
    cmd = f"{sys.executable} launch.py --dtype {ns.dtype} --profile-steps --disable-radix-cache {ns.extra}"
    rows = []
    with LaunchedServer(cmd, log) as server, httpx.Client(timeout=60) as client:
        model = client.get(server.base_url + "/v1/models").json()["data"][0]["id"]
        for _ in range(3):  # warm-up: first-call allocations, caches
            first_token_time(client, server.base_url, model, ns.prompt)
        time.sleep(0.5)
        for i in range(ns.requests):
            seen = len(prefill_steps(log, 0))
            ttft, stream_end = first_token_time(client, server.base_url, model, f"{ns.prompt} {i}")
            time.sleep(0.2)  # the log line is written after the result is handled
            steps = prefill_steps(log, seen)
            if len(steps) != 1:
                raise RuntimeError(f"request {i}: expected one prefill step in the log, found {len(steps)}")
            sent_to_result, forward = steps[0]
            whole = whole_response_time(client, server.base_url, model, f"{ns.prompt} {i}")
            rows.append(
                {
                    "ttft_ms": ttft * 1e3,
                    "stream_end_ms": stream_end * 1e3,
                    "non_streamed_ms": whole * 1e3,
                    "forward_ms": forward,
                    "sent_to_result_ms": sent_to_result,
                }
            )
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    overhead = statistics.median(r["ttft_ms"] - r["forward_ms"] for r in rows)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": cmd,
        "requests": len(rows),
        "median_ttft_ms": med["ttft_ms"],
        "median_prefill_forward_ms": med["forward_ms"],
        "median_scheduler_sent_to_result_ms": med["sent_to_result_ms"],
        "median_ttft_minus_forward_ms": overhead,
        "median_stream_end_ms": med["stream_end_ms"],
        "median_non_streamed_ms": med["non_streamed_ms"],
        "loadavg": os.getloadavg(),
        "rows": rows,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}, indent=2))
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
