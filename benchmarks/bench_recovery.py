"""Recovery time: from SIGKILL of a process to the next token a streaming client receives.

    python benchmarks/bench_recovery.py [--role worker|scheduler] [--repeats 3] [--launch "python launch.py ..."]

A streaming request (ignore_eos, long max_tokens) runs; once tokens flow, the chosen
process is killed. The gap between the kill and the next token, and the longest gap
between two tokens of that stream, are reported; the text must continue unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launched_server import LaunchedServer, child_process  # noqa: E402
from serving_report import print_and_write_report  # noqa: E402


def one_recovery(base_url: str, root_pid: int, title: str, max_tokens: int) -> dict:
    arrivals: list[float] = []
    done = threading.Event()

    def stream() -> None:
        body = {
            "text": "Once upon a time",
            "stream": True,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        }
        with httpx.stream("POST", base_url + "/generate", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    arrivals.append(time.perf_counter())
        done.set()

    threading.Thread(target=stream, daemon=True).start()
    while len(arrivals) < 10:
        time.sleep(0.01)
    victim = child_process(root_pid, title)
    killed_at = time.perf_counter()
    victim.send_signal(signal.SIGKILL)
    done.wait(600)
    after = [t for t in arrivals if t > killed_at]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {
        "kill_to_next_token_s": after[0] - killed_at if after else None,
        "longest_gap_s": max(gaps),
        "events": len(arrivals),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=["worker", "scheduler"], default="worker")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--launch", default="python launch.py --dtype bfloat16 --max-total-tokens 16384")
    p.add_argument("--output-json", default="benchmarks/results/recovery.json")
    ns = p.parse_args(argv)
    title = "trident::worker[tp0]" if ns.role == "worker" else "trident::scheduler"
    os.makedirs(os.path.dirname(os.path.abspath(ns.output_json)), exist_ok=True)
    runs = []
    with LaunchedServer(ns.launch, os.path.splitext(ns.output_json)[0] + ".log") as server:
        for i in range(ns.repeats):
            run = one_recovery(server.base_url, server.proc.pid, title, ns.max_tokens)
            print(f"[{i + 1}/{ns.repeats}] {json.dumps(run)}", flush=True)
            runs.append(run)
    times = sorted(r["kill_to_next_token_s"] for r in runs if r["kill_to_next_token_s"] is not None)
    report = {
        "role": ns.role,
        "launch": ns.launch,
        "runs": runs,
        "median_kill_to_next_token_s": times[len(times) // 2] if times else None,
    }
    print_and_write_report(report, ns.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
