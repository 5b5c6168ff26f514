"""benchmarks/bench_serving.py, run as a user runs it, against the real SmolLM2 server.

The load generator is how every performance claim is measured, so its counts must be the
server's: each request gets exactly the output it asked for, prompts are as long as the
workload says, and the JSON holds one row per request.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import REPO_ROOT, wait_until


def run_bench(server, tmp_path, *args: str) -> dict:
    out = tmp_path / "result.json"
    cmd = [sys.executable, os.path.join(REPO_ROOT, "benchmarks", "bench_serving.py"), "--base-url", server.base_url]
    cmd += [*args, "--warmup-requests", "1", "--disable-tqdm", "--output-json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(out.read_text())


def test_random_workload_gets_exactly_the_asked_tokens_and_reports_latencies(smollm2_server, tmp_path):
    doc = run_bench(
        smollm2_server,
        tmp_path,
        *("--dataset", "random", "--num-prompts", "5", "--random-input-len", "8-24", "--random-output-len", "3-9"),
        *("--concurrency-sweep", "1,4"),
    )
    stats = doc["workload_stats"]
    assert [r["concurrency"] for r in doc["runs"]] == [1, 4]
    for run in doc["runs"]:
        assert (run["completed"], run["failed"], run["output_len_mismatches"]) == (5, 0, 0)
        # Prompts are words that are one token each, so the server counts what the workload planned.
        assert run["total_input_tokens"] == stats["prompt_tokens"]
        assert run["total_output_tokens"] == stats["output_tokens"]
        assert run["requests"]["completion_tokens"] == run["requests"]["requested_output"]
        assert 0 < run["ttft_ms"]["median"] <= run["e2e_latency_ms"]["median"]
        assert run["itl_ms"]["median"] > 0


def test_shared_prefix_workload_reuses_the_cached_system_prompt(smollm2_server, tmp_path):
    def computed() -> int:
        return smollm2_server.http().get("/server_info").json()["scheduler_stats"]["prefill_tokens_computed"]

    before = computed()
    doc = run_bench(
        smollm2_server,
        tmp_path,
        *("--dataset", "shared-prefix", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3"),
        *("--gsp-system-prompt-len", "64", "--gsp-question-len", "4", "--gsp-output-len", "2"),
        *("--max-concurrency", "1"),
    )
    (run,) = doc["runs"]
    assert (run["completed"], run["failed"], run["output_len_mismatches"]) == (6, 0, 0)
    assert run["total_input_tokens"] == doc["workload_stats"]["prompt_tokens"]
    # Sent one at a time after a cache flush, the 2nd and 3rd request of each group find the
    # system prompt cached: four times 64 tokens are not computed (the warm-up adds one prompt).
    prompt = max(doc["workload_stats"]["prompt_len_min_max"])
    assert wait_until(lambda: computed() - before <= run["total_input_tokens"] + prompt - 4 * 60, 10), (
        computed() - before
    )


def test_frontend_cpu_bench_measures_each_process_against_a_simulated_worker(tmp_path):
    out = tmp_path / "frontend.json"
    cmd = [sys.executable, os.path.join(REPO_ROOT, "benchmarks", "bench_frontend_cpu.py"), "--step-ms", "5"]
    cmd += ["--num-prompts", "8", "--concurrency", "4", "--input-len", "16", "--output-len", "12", "--rounds", "1"]
    proc = subprocess.run([*cmd, "--output-json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (run,) = json.loads(out.read_text())["rounds"]
    assert run["output_tokens"] == 8 * 12
    # 8 requests of 12 tokens, 4 at a time: at least two waves of 12 decode steps.
    assert run["steps"] >= 2 * 12
    assert set(run["cpu_ms_per_step"]) == {"tokenizer", "scheduler", "worker", "launcher", "client"}
    # The launcher only watches its children: over so short a run it may not use a clock tick.
    assert all(ms > 0 for role, ms in run["cpu_ms_per_step"].items() if role != "launcher")
