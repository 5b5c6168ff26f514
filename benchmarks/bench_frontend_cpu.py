"""CPU the front end spends per decode step: tokenizer, scheduler and client, measured apart.

    python benchmarks/bench_frontend_cpu.py --rounds 3
    python benchmarks/bench_frontend_cpu.py --worker real --rounds 3   # the bundled model

On a CPU-only machine the tokenizer, the scheduler and the benchmark client run on the
same cores as the worker's threads, so every millisecond they spend per step is taken from
the forward (and costs it more than a millisecond: a preempted thread stalls its teammate).
By default this measures that CPU without the model: trident runs with a simulated worker
whose every step takes `--step-ms` (profiles' `const_s`), so the cores are otherwise idle
and the numbers are steady. `--worker real` serves the model `--launch-args` names (the
bundled one by default) to see the same processes beside a worker that takes the cores.
The workload is compare_vllm's: `--num-prompts` streamed completions, `--concurrency` at a
time, `--input-len` / `--output-len` tokens; or, with `--workload`, one of bench_simulation's
(decode, prefill, mixed), to see what each kind of step costs the front end (the prompt
tokens it tokenizes, the rows it streams).

Per round it reports, from /proc (user + system time of every thread of each process)
and the scheduler's step counter, CPU ms per scheduler step and CPU µs per output token of
the tokenizer, the scheduler, the worker, the launcher (supervisor) and the client (this
process, while the requests stream), and the front end's (tokenizer and scheduler) CPU µs
per prompt and per output token. CPU time, unlike wall time, barely moves when other jobs
share the cores, so these figures hold on a busy host. To see where a process spends it,
attach a sampling profiler during a round, e.g. `py-spy record -p PID -r 200 -f raw`
(the processes' titles are `trident::tokenizer`, `trident::scheduler`, ...).
`--launch-cwd` runs another checkout's launch.py, to compare two versions in one sitting.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from typing import Any

import httpx
import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import build_parser, run_against, workload_spec  # noqa: E402
from bench_simulation import WORKLOADS  # noqa: E402
from launched_server import REPO_ROOT, LaunchedServer, child_process, cpu_seconds  # noqa: E402
from serving_report import write_json  # noqa: E402
from serving_workload import build_workload, load_tokenizer  # noqa: E402

sys.path.insert(0, REPO_ROOT)
from gpu_worker.sim.step_profile import COEFFICIENT_NAMES, StepProfile  # noqa: E402

ROLE_TITLES = {"tokenizer": "trident::tokenizer", "scheduler": "trident::scheduler", "worker": "trident::worker[tp0]"}
ROLES = (*ROLE_TITLES, "launcher", "client")


def write_constant_profile(step_ms: float, directory: str) -> str:
    path = os.path.join(directory, f"constant-{step_ms:g}ms.json")
    coefficients = {name: 0.0 for name in COEFFICIENT_NAMES} | {"const_s": step_ms / 1e3}
    StepProfile(coefficients, f"every step takes {step_ms:g} ms (bench_frontend_cpu.py)", "hand-written").save(path)
    return path


def scheduler_steps(base_url: str) -> int:
    return int(httpx.get(base_url + "/server_info", timeout=10).json()["scheduler_stats"]["steps"])


def one_round(base_url: str, procs: dict[str, psutil.Process], ns: argparse.Namespace, requests: list) -> dict:
    before = {role: cpu_seconds(p) for role, p in procs.items()}
    steps_before = scheduler_steps(base_url)
    doc = run_against(base_url, ns, requests)
    time.sleep(1.5)  # the scheduler publishes its final step count once idle
    steps = scheduler_steps(base_url) - steps_before
    cpu_ms = {role: (cpu_seconds(p) - before[role]) * 1e3 for role, p in procs.items()}
    run = doc["runs"][0]
    # The client's CPU while the requests stream (bench_serving measures it), not its set-up or report.
    cpu_ms["client"] = run["client_cpu_share"] * run["duration_s"] * 1e3
    front_end_ms = cpu_ms["tokenizer"] + cpu_ms["scheduler"]
    return {
        "steps": steps,
        "output_tokens": run["total_output_tokens"],
        "prompt_tokens": run["total_input_tokens"],
        "front_end_us_per_prompt_token": front_end_ms * 1e3 / run["total_input_tokens"],
        "front_end_us_per_output_token": front_end_ms * 1e3 / run["total_output_tokens"],
        "cpu_ms_per_step": {role: ms / steps for role, ms in cpu_ms.items()},
        "cpu_us_per_output_token": {role: ms * 1e3 / run["total_output_tokens"] for role, ms in cpu_ms.items()},
        "median_tpot_ms": run["tpot_ms"]["median"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=("simulated", "real"), default="simulated", help="which worker serves")
    p.add_argument("--step-ms", type=float, default=60.0, help="the simulated worker's step time")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default=None, help="bench_simulation's workload")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--launch-args", default="--max-running-requests 64", help="extra launch.py flags")
    p.add_argument("--launch-cwd", default=REPO_ROOT, help="the checkout whose launch.py runs")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)

    if args.workload:
        ns = build_parser().parse_args(WORKLOADS[args.workload])
    else:
        ns = build_parser().parse_args([])
        ns.dataset, ns.num_prompts = "random", args.num_prompts
        ns.random_input_len, ns.random_output_len = (args.input_len,) * 2, (args.output_len,) * 2
        ns.max_concurrency = args.concurrency
    # A workload's rounds count only its own tokens (the first round also pays first-time costs).
    ns.seed, ns.disable_tqdm, ns.label, ns.warmup_requests = args.seed, True, "frontend", 0 if args.workload else 2
    requests = build_workload(workload_spec(ns), load_tokenizer(ns.tokenizer))

    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        profile = write_constant_profile(args.step_ms, tmp)
        worker = f"--worker simulated --sim-profile {profile}" if args.worker == "simulated" else ""
        cmd = f"{shlex.quote(sys.executable)} launch.py {worker} {args.launch_args}"
        with LaunchedServer(cmd, os.path.join(tmp, "server.log"), cwd=args.launch_cwd) as server:
            procs = {role: child_process(server.proc.pid, title) for role, title in ROLE_TITLES.items()}
            procs["launcher"] = psutil.Process(server.proc.pid)
            for i in range(args.rounds):
                r = one_round(server.base_url, procs, ns, requests)
                rounds.append(r)
                per = "  ".join(f"{role} {ms:.2f}" for role, ms in r["cpu_ms_per_step"].items())
                per_token = "  ".join(f"{role} {us:.1f}" for role, us in r["cpu_us_per_output_token"].items())
                print(
                    f"round {i + 1}: {r['steps']} steps, CPU ms a step: {per}; CPU µs an output token: {per_token};"
                    f" front end µs a prompt token {r['front_end_us_per_prompt_token']:.1f},"
                    f" an output token {r['front_end_us_per_output_token']:.1f}",
                    flush=True,
                )
    medians = {role: statistics.median(r["cpu_ms_per_step"][role] for r in rounds) for role in ROLES}
    per_token = {role: statistics.median(r["cpu_us_per_output_token"][role] for r in rounds) for role in ROLES}
    front = medians["tokenizer"] + medians["scheduler"] + medians["client"]
    print("median CPU ms a step: " + "  ".join(f"{role} {ms:.2f}" for role, ms in medians.items()))
    print("median CPU µs an output token: " + "  ".join(f"{role} {us:.1f}" for role, us in per_token.items()))
    print(f"front end (tokenizer + scheduler + client): {front:.2f} ms a step")
    if args.output_json:
        doc = {"median_cpu_ms_per_step": medians, "median_cpu_us_per_output_token": per_token}
        write_json({"args": vars(args), "rounds": rounds, **doc}, args.output_json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
