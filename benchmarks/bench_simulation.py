"""Fidelity of the simulated worker: does the real scheduler behind simulated workers
serve a workload as fast as it does behind the model?

In one command, on this machine:

1. fit: start trident on the real model with `--record-batches`, run bench_serving's
   `random` workload (a different workload from the one compared), stop it, and fit a
   step-time profile from the recording (`python -m gpu_worker.fit_profile`, by default
   with the step times the worker measured while serving: `--timing recorded`);
2. real: start trident on the real model, run the `mixed` workload (48 requests, prompts of
   32-256 words, outputs of 16-192 tokens, ignore_eos, all at once), stop it;
3. simulated: the same with `--worker simulated --sim-profile <the fitted profile>`;

and report output throughput, median TTFT and median ITL of both and simulated / real
(the goal: each within 10 %). Steps 2 and 3 alternate `--repeats` times and each metric is
the median over the repeats: on this machine two real runs of the same workload differ by
up to 30 % (the spread is reported), more than the tolerance. Example:

    python benchmarks/bench_simulation.py --dtype bfloat16 --output-json benchmarks/results/sim_fidelity.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import build_parser, run_against, workload_spec  # noqa: E402
from launched_server import REPO_ROOT, LaunchedServer  # noqa: E402
from serving_report import write_json  # noqa: E402
from serving_workload import build_workload, load_tokenizer  # noqa: E402

RESULTS = os.path.join(REPO_ROOT, "benchmarks", "results")
COMPARED = {
    "output_throughput": lambda run: run["output_throughput"],
    "median_ttft_ms": lambda run: run["ttft_ms"]["median"],
    "median_itl_ms": lambda run: run["itl_ms"]["median"],
}


def serve(label: str, launch_args: list[str], bench_args: list[str]) -> dict[str, Any]:
    """Starts `launch.py` with launch_args, runs bench_serving with bench_args, stops it."""
    args = build_parser().parse_args([*bench_args, "--label", label, "--disable-tqdm"])
    requests = build_workload(workload_spec(args), load_tokenizer(args.tokenizer))
    command = " ".join([sys.executable, "launch.py", *launch_args])
    log = os.path.join(RESULTS, f"{label}-{time.strftime('%Y%m%d-%H%M%S')}.log")
    with LaunchedServer(command, log) as server:
        doc = run_against(server.base_url, args, requests)
    if any(run["failed"] for run in doc["runs"]):
        raise RuntimeError(f"{label}: requests failed: {doc['runs'][0]['errors']}")
    return doc


def fit_profile(ns: argparse.Namespace, model_args: list[str]) -> str:
    recording = os.path.join(RESULTS, "sim_fit_random.rec")
    if os.path.exists(recording):
        os.remove(recording)
    fit_workload = [
        "--dataset",
        "random",
        "--num-prompts",
        str(ns.fit_prompts),
        "--random-input-len",
        "16-512",
        "--random-output-len",
        "8-256",
        "--seed",
        "7",
        "--request-rate",
        str(ns.fit_request_rate),
    ]
    serve("fit-random", [*model_args, "--record-batches", recording], fit_workload)
    profile = ns.profile_out
    cmd = [
        sys.executable,
        "-m",
        "gpu_worker.fit_profile",
        recording,
        "-o",
        profile,
        "--timing",
        ns.timing,
        "--passes",
        str(ns.passes),
        "--loss",
        ns.loss,
        "--description",
        f"SmolLM2-135M {ns.dtype}, this machine (fitted on the random workload)",
    ]
    subprocess.run(cmd, cwd=REPO_ROOT, check=True)
    return profile


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--profile", default=None, help="use this profile instead of fitting one")
    p.add_argument("--profile-out", default=os.path.join(RESULTS, "sim_fitted_profile.json"))
    p.add_argument("--fit-prompts", type=int, default=48, help="requests of the random workload fitted on")
    p.add_argument(
        "--fit-request-rate",
        type=float,
        default=2.0,
        help="Poisson arrivals per second of the fitted workload: arrivals spread over time give prefill "
        "chunks of many sizes next to decode rows, so a token's cost and a logit row's can be told apart "
        "(all at once, nearly every step is a pure decode step, where the two are the same count)",
    )
    p.add_argument(
        "--timing",
        choices=["recorded", "replay"],
        default="recorded",
        help="step times for the fit: the served run's own (recorded) or a replay on the model (fit_profile)",
    )
    p.add_argument("--passes", type=int, default=2, help="replays of the recording with --timing replay")
    p.add_argument("--loss", choices=["relative", "absolute"], default="relative", help="fit_profile's --loss")
    p.add_argument("--repeats", type=int, default=3, help="real and simulated runs, alternating")
    p.add_argument("--output-json", default=os.path.join(RESULTS, "sim_fidelity.json"))
    ns = p.parse_args(argv)
    os.makedirs(RESULTS, exist_ok=True)
    model_args = ["--dtype", ns.dtype]
    profile = ns.profile or fit_profile(ns, model_args)
    mixed = ["--dataset", "mixed"]
    sim_args = [*model_args, "--worker", "simulated", "--sim-profile", profile]
    real_docs, sim_docs = [], []
    for i in range(ns.repeats):
        real_docs.append(serve(f"real-mixed-{i + 1}", model_args, mixed))
        sim_docs.append(serve(f"sim-mixed-{i + 1}", sim_args, mixed))
    real = {name: [get(doc["runs"][0]) for doc in real_docs] for name, get in COMPARED.items()}
    sim = {name: [get(doc["runs"][0]) for doc in sim_docs] for name, get in COMPARED.items()}
    ratios = {name: float(np.median(sim[name]) / np.median(real[name])) for name in COMPARED}
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "profile": json.load(open(profile)),
        "real": {name: float(np.median(v)) for name, v in real.items()},
        "simulated": {name: float(np.median(v)) for name, v in sim.items()},
        "simulated_over_real": ratios,
        "within_10_percent": {name: abs(v - 1) <= 0.10 for name, v in ratios.items()},
        "real_spread_max_over_min": {name: max(v) / min(v) for name, v in real.items()},
        "simulated_spread_max_over_min": {name: max(v) / min(v) for name, v in sim.items()},
        "every_repeat": {"real": real, "simulated": sim},
        "loadavg_1min": {
            "real": [doc["runs"][0]["loadavg_1min_before_after"] for doc in real_docs],
            "simulated": [doc["runs"][0]["loadavg_1min_before_after"] for doc in sim_docs],
        },
        "runs": {"real": real_docs, "simulated": sim_docs},
    }
    print(
        json.dumps(
            {
                k: report[k]
                for k in ("real", "simulated", "simulated_over_real", "within_10_percent", "real_spread_max_over_min")
            },
            indent=2,
        )
    )
    write_json(report, ns.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
