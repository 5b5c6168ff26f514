"""Recovery time: from SIGKILL of a process to the next token a streaming client receives.

    python benchmarks/bench_recovery.py [--role worker|scheduler|tokenizer] [--repeats 3]
        [--launch "python launch.py ..."]

A streaming request (ignore_eos, long max_tokens) runs; once tokens flow, the chosen
process is killed. The time from the kill to the token that ends the outage (the longest
gap that ends after the kill), and the longest gap between two tokens of that stream, are
reported; the text must continue unchanged.

The tokenizer holds the client's connection, so its death ends that stream (the request
is aborted, as a client's disconnect would): for it the figures are the kill to the
first /health answered 200 again, and to the first token of a request sent then.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launched_server import LaunchedServer, child_process  # noqa: E402
from serving_report import print_and_write_report  # noqa: E402

from trident.restart_policy import SETTLE_S  # noqa: E402

TITLES = {"worker": "trident::worker[tp0]", "scheduler": "trident::scheduler", "tokenizer": "trident::tokenizer"}
"""The process each --role kills, by the title it sets."""
HEALTH_DEADLINE_S = 120.0
"""How long the tokenizer may take to answer /health again before the run is called failed."""


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
    gaps = [(b - a, b) for a, b in zip(arrivals, arrivals[1:])]
    # A token already on its way when the kill lands may arrive just after it: the stream
    # resumes at the end of the longest gap that ends after the kill.
    outage = max((gap for gap in gaps if gap[1] > killed_at), default=None)
    return {
        "kill_to_next_token_s": outage[1] - killed_at if outage else None,
        "longest_gap_s": max(gaps)[0],
        "events": len(arrivals),
    }


def one_tokenizer_recovery(base_url: str, root_pid: int, max_tokens: int) -> dict:
    """The kill to /health 200 again, and to the first token of a request sent then."""

    def first_token(http: httpx.Client) -> None:
        body = {"text": "Once upon a time", "stream": True, "sampling_params": {"max_new_tokens": max_tokens}}
        with http.stream("POST", base_url + "/generate", json=body, timeout=600) as r:
            r.raise_for_status()
            next(line for line in r.iter_lines() if line.startswith("data:"))

    with httpx.Client() as http:
        first_token(http)
        victim = child_process(root_pid, TITLES["tokenizer"])
        killed_at = time.perf_counter()
        victim.send_signal(signal.SIGKILL)
        while time.perf_counter() - killed_at < HEALTH_DEADLINE_S:
            try:
                if http.get(base_url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass  # the port is closed until the new tokenizer binds it
            time.sleep(0.02)
        else:
            raise RuntimeError(f"the tokenizer did not answer /health within {HEALTH_DEADLINE_S:.0f} s of its kill")
        healthy_at = time.perf_counter()
        first_token(http)
        return {"kill_to_health_s": healthy_at - killed_at, "kill_to_next_token_s": time.perf_counter() - killed_at}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=list(TITLES), default="worker")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--launch", default="python launch.py --dtype bfloat16 --max-total-tokens 16384")
    p.add_argument("--output-json", default="benchmarks/results/recovery.json")
    ns = p.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(ns.output_json)), exist_ok=True)
    runs = []
    with LaunchedServer(ns.launch, os.path.splitext(ns.output_json)[0] + ".log") as server:
        for i in range(ns.repeats):
            if i:
                # A process that dies within SETTLE_S of coming up is a quick failure, restarted
                # after a backoff (restart_policy.py): wait until its death is a fault again.
                time.sleep(SETTLE_S + 1)
            if ns.role == "tokenizer":
                run = one_tokenizer_recovery(server.base_url, server.proc.pid, ns.max_tokens)
            else:
                run = one_recovery(server.base_url, server.proc.pid, TITLES[ns.role], ns.max_tokens)
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
