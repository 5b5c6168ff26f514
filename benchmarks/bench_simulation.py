"""Fidelity of the simulated worker: does the real scheduler behind simulated workers
serve a workload as fast as it does behind the model?

In one command, on this machine:

1. fit (`--fit sweep`, the default): time the model worker alone over a grid of step
   shapes (`python -m gpu_worker.sim.fit_profile --sweep`); the simulated workers measure the
   front end's share of the cores live. `--fitted-frontend` fits that share instead on a
   served recording of bench_serving's `random` workload at 2 requests/s
   (`--frontend-from`). `--fit recording` fits on that recording alone, as before the
   sweep existed. `--profile` skips the fit;
2. for each of `--workloads`, none of them the fitted one:
   - `decode`: 32 requests, 64-token prompts, 128 output tokens;
   - `prefill`: 8 requests, prompts of 1,000-1,200 tokens, 16 output tokens;
   - `mixed`: 48 requests, prompts of 32-256 words, outputs of 16-192 tokens;
   all at once, ignore_eos: start trident on the real model, run it, stop it; then the same
   with `--worker simulated --sim-profile <the profile>`; alternating `--repeats` times.

Round i runs its servers with `--seed i`, so that the simulated workers' draws from the
profile's spread differ from round to round, as the host's noise does for the real ones.
It reports output throughput, median TTFT and median ITL of both and simulated / real
per workload (the goal: each within 10 %), each metric the median over the repeats: on a
shared host two real runs of the same workload can differ by more than the tolerance (the
spread is reported). With `--ablate-frontend` each round also runs a third
server: the same profile without the front end's contention, to show what it adds. With
`--record-dir` every server records its steps (LABEL.rec), and
benchmarks/compare_step_timelines.py sets a real and a simulated run side by side, step by
step. Example:

    python benchmarks/bench_simulation.py --dtype bfloat16 --repeats 2 \
        --profile-out trident/profiles/cpu-smollm2-bf16.json
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

sys.path.insert(0, REPO_ROOT)
from gpu_worker.sim.step_profile import StepProfile  # noqa: E402
from trident.model_source import default_model_path  # noqa: E402

RESULTS = os.path.join(REPO_ROOT, "benchmarks", "results")
COMPARED = {
    "output_throughput": lambda run: run["output_throughput"],
    "median_ttft_ms": lambda run: run["ttft_ms"]["median"],
    "median_itl_ms": lambda run: run["itl_ms"]["median"],
}


def serve(label: str, launch_args: list[str], bench_args: list[str], record_dir: str | None = None) -> dict[str, Any]:
    """Starts `launch.py` with launch_args, runs bench_serving with bench_args, stops it;
    with `record_dir`, the server records its steps there as LABEL.rec."""
    if record_dir:
        os.makedirs(record_dir, exist_ok=True)
        recording = os.path.join(record_dir, f"{label}.rec")
        if os.path.exists(recording):
            os.remove(recording)  # the recorder would start a new file beside it
        launch_args = [*launch_args, "--record-batches", recording]
    args = build_parser().parse_args([*bench_args, "--label", label, "--disable-tqdm"])
    requests = build_workload(workload_spec(args), load_tokenizer(args.tokenizer))
    command = " ".join([sys.executable, "launch.py", *launch_args])
    log = os.path.join(RESULTS, f"{label}-{time.strftime('%Y%m%d-%H%M%S')}.log")
    with LaunchedServer(command, log) as server:
        doc = run_against(server.base_url, args, requests)
    if any(run["failed"] for run in doc["runs"]):
        raise RuntimeError(f"{label}: requests failed: {doc['runs'][0]['errors']}")
    return doc


WORKLOADS = {
    "decode": ["--dataset", "random", "--num-prompts", "32", "--random-input-len", "64", "--random-output-len", "128"],
    "prefill": [
        *("--dataset", "random", "--num-prompts", "8"),
        *("--random-input-len", "1000-1200", "--random-output-len", "16"),
    ],
    "mixed": ["--dataset", "mixed"],
}


def record_fit_workload(ns: argparse.Namespace, model_args: list[str]) -> str:
    """A served recording of the `random` workload with Poisson arrivals (not compared)."""
    recording = os.path.join(RESULTS, "sim_fit_random.rec")
    if os.path.exists(recording):
        os.remove(recording)
    fit_workload = [
        *("--dataset", "random", "--num-prompts", str(ns.fit_prompts), "--seed", "7"),
        *("--random-input-len", "16-512", "--random-output-len", "8-256"),
        *("--request-rate", str(ns.fit_request_rate)),
    ]
    serve("fit-random", [*model_args, "--record-batches", recording], fit_workload)
    return recording


def fit_profile(ns: argparse.Namespace, model_args: list[str]) -> str:
    cmd = [sys.executable, "-m", "gpu_worker.sim.fit_profile", "-o", ns.profile_out, "--loss", ns.loss]
    if ns.fit == "sweep":
        cmd += ["--sweep", "--model", default_model_path(), "--dtype", ns.dtype, "--repeats", str(ns.sweep_repeats)]
        if ns.fitted_frontend:
            cmd += ["--frontend-from", record_fit_workload(ns, model_args)]
        described = "sweep of step shapes" + (", front end fitted on the random workload" if ns.fitted_frontend else "")
    else:
        cmd += [record_fit_workload(ns, model_args), "--timing", ns.timing, "--passes", str(ns.passes)]
        described = "the random workload"
    cmd += ["--description", f"SmolLM2-135M {ns.dtype}, fitted on a {described}"]
    subprocess.run(cmd, cwd=REPO_ROOT, check=True)
    return ns.profile_out


def profile_path(profile: str) -> str:
    """A profile's file, given its path or a packaged name (as --sim-profile takes it)."""
    packaged = os.path.join(REPO_ROOT, "trident", "profiles", profile.removesuffix(".json") + ".json")
    return profile if os.path.isfile(profile) else packaged


def without_frontend(profile: str) -> str:
    """A copy of the profile that simulates a worker alone: no fitted share, no live contention."""
    alone = StepProfile.load(profile_path(profile))
    alone.frontend, alone.worker_threads, alone.host_cores = {}, 0, 0
    path = os.path.join(RESULTS, "sim_profile_without_frontend.json")
    alone.save(path)
    return path


def compare(name: str, real_docs: list[dict], sim_docs: list[dict]) -> dict[str, Any]:
    """Simulated / real of the medians over the repeats of one workload."""
    real = {metric: [get(doc["runs"][0]) for doc in real_docs] for metric, get in COMPARED.items()}
    sim = {metric: [get(doc["runs"][0]) for doc in sim_docs] for metric, get in COMPARED.items()}
    ratios = {metric: float(np.median(sim[metric]) / np.median(real[metric])) for metric in COMPARED}
    return {
        "workload": WORKLOADS[name],
        "real": {metric: float(np.median(v)) for metric, v in real.items()},
        "simulated": {metric: float(np.median(v)) for metric, v in sim.items()},
        "simulated_over_real": ratios,
        "within_10_percent": {metric: abs(v - 1) <= 0.10 for metric, v in ratios.items()},
        "real_spread_max_over_min": {metric: max(v) / min(v) for metric, v in real.items()},
        "simulated_spread_max_over_min": {metric: max(v) / min(v) for metric, v in sim.items()},
        "every_repeat": {"real": real, "simulated": sim},
        "loadavg_1min": {
            "real": [doc["runs"][0]["loadavg_1min_before_after"] for doc in real_docs],
            "simulated": [doc["runs"][0]["loadavg_1min_before_after"] for doc in sim_docs],
        },
        "runs": {"real": real_docs, "simulated": sim_docs},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--profile", default=None, help="use this profile (a file or a packaged name) instead of fitting")
    p.add_argument("--profile-out", default=os.path.join(RESULTS, "sim_fitted_profile.json"))
    p.add_argument("--fit", choices=["sweep", "recording"], default="sweep", help="what the profile is fitted on")
    p.add_argument("--sweep-repeats", type=int, default=3, help="fit_profile --sweep --repeats")
    p.add_argument(
        "--fitted-frontend",
        action="store_true",
        help="--fit sweep: fit the front end's share on a served recording instead of measuring it live",
    )
    p.add_argument("--fit-prompts", type=int, default=48, help="requests of the recorded random workload")
    p.add_argument(
        "--fit-request-rate",
        type=float,
        default=2.0,
        help="Poisson arrivals per second of the recorded workload: arrivals spread over time give prefill "
        "chunks of many sizes next to decode rows",
    )
    p.add_argument(
        "--timing",
        choices=["recorded", "replay"],
        default="recorded",
        help="--fit recording: step times of the served run (recorded) or of a replay on the model",
    )
    p.add_argument("--passes", type=int, default=2, help="replays of the recording with --timing replay")
    p.add_argument("--loss", choices=["relative", "absolute"], default="relative", help="fit_profile's --loss")
    p.add_argument("--workloads", default="decode,prefill,mixed", help=f"comma-separated, of {sorted(WORKLOADS)}")
    p.add_argument("--repeats", type=int, default=3, help="real and simulated runs of each workload, alternating")
    p.add_argument(
        "--ablate-frontend",
        action="store_true",
        help="also run each round on the profile without the front end's contention",
    )
    p.add_argument(
        "--record-dir",
        default=None,
        help="record every server's steps there (LABEL.rec; benchmarks/compare_step_timelines.py reads them)",
    )
    p.add_argument("--output-json", default=os.path.join(RESULTS, "sim_fidelity.json"))
    ns = p.parse_args(argv)
    workloads = ns.workloads.split(",")
    if unknown := set(workloads) - set(WORKLOADS):
        p.error(f"unknown workloads {sorted(unknown)}")
    os.makedirs(RESULTS, exist_ok=True)
    model_args = ["--dtype", ns.dtype]
    profile = ns.profile or fit_profile(ns, model_args)
    sims = {"sim": profile} | ({"sim-alone": without_frontend(profile)} if ns.ablate_frontend else {})
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "workloads": {}}
    for name in workloads:
        real_docs: list[dict] = []
        sim_docs: dict[str, list[dict]] = {label: [] for label in sims}
        for i in range(ns.repeats):
            # Each round seeds its servers apart: a simulated worker draws its steps' spread
            # from a sequence seeded by --seed, and one seed would give every round the same
            # draws (the mixed workload's second big step drew 0.86 in every round).
            round_args = [*model_args, "--seed", str(i + 1)]
            real_docs.append(serve(f"real-{name}-{i + 1}", round_args, WORKLOADS[name], ns.record_dir))
            for label, path in sims.items():
                sim_args = [*round_args, "--worker", "simulated", "--sim-profile", path]
                sim_docs[label].append(serve(f"{label}-{name}-{i + 1}", sim_args, WORKLOADS[name], ns.record_dir))
        report["workloads"][name] = compare(name, real_docs, sim_docs["sim"])
        if ns.ablate_frontend:
            report["workloads"][name]["without_frontend"] = compare(name, real_docs, sim_docs["sim-alone"])
        write_json(report, ns.output_json)  # what is done so far survives a later failure
    with open(profile_path(profile)) as f:
        report["profile"] = json.load(f)
    summary = {
        name: {k: w[k] for k in ("real", "simulated", "simulated_over_real", "real_spread_max_over_min")}
        | ({"without_frontend": w["without_frontend"]["simulated_over_real"]} if ns.ablate_frontend else {})
        for name, w in report["workloads"].items()
    }
    print(json.dumps(summary, indent=2))
    write_json(report, ns.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
