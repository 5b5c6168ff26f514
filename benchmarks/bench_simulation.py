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
(the goal: each within 10 %). Example:

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
        "--timing",
        choices=["recorded", "replay"],
        default="recorded",
        help="step times for the fit: the served run's own (recorded) or a replay on the model (fit_profile)",
    )
    p.add_argument("--passes", type=int, default=2, help="replays of the recording with --timing replay")
    p.add_argument("--output-json", default=os.path.join(RESULTS, "sim_fidelity.json"))
    ns = p.parse_args(argv)
    os.makedirs(RESULTS, exist_ok=True)
    model_args = ["--dtype", ns.dtype]
    profile = ns.profile or fit_profile(ns, model_args)
    mixed = ["--dataset", "mixed"]
    real = serve("real-mixed", model_args, mixed)
    sim = serve("sim-mixed", [*model_args, "--worker", "simulated", "--sim-profile", profile], mixed)
    r, s = real["runs"][0], sim["runs"][0]
    ratios = {name: get(s) / get(r) for name, get in COMPARED.items()}
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "profile": json.load(open(profile)),
        "real": {name: get(r) for name, get in COMPARED.items()},
        "simulated": {name: get(s) for name, get in COMPARED.items()},
        "simulated_over_real": ratios,
        "within_10_percent": {name: abs(v - 1) <= 0.10 for name, v in ratios.items()},
        "loadavg_1min": {"real": r["loadavg_1min_before_after"], "simulated": s["loadavg_1min_before_after"]},
        "runs": {"real": real, "simulated": sim},
    }
    print(
        json.dumps({k: report[k] for k in ("real", "simulated", "simulated_over_real", "within_10_percent")}, indent=2)
    )
    write_json(report, ns.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
