"""Tensor parallelism on CPU with gloo: real launch.py servers, one worker process per rank.

Greedy output at tp N equals tp 1: on the real SmolLM2 at tp 3 (9 heads, 3 KV heads: an
even split) and at tp 2 (uneven: heads 0-3 | 4-8, KV head 1 replicated on both ranks), and
on the fault suite's random-weight model (4 heads, 2 KV heads) at tp 2 and tp 4. More ranks
than heads is a one-line start-up error. SIGKILL of rank 1 mid-generation restarts the whole
group on a fresh rendezvous port and every request still completes with unchanged greedy
output.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import pytest

from gpu_worker.model.model_config import ModelConfig
from gpu_worker.runtime.parallel import ShardPlan
from tests.helpers import REPO_ROOT, Server, free_port, running_server
from tests.workload import child, run_with_fault

SMOLLM2_FLAGS = ["--dtype", "float32", "--max-total-tokens", "16384", "--check-seq-lens"]  # as smollm2_server
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]
RANDOM_FLAGS = ["--dtype", "float32", "--max-total-tokens", "8192", "--chunked-prefill-size", "16", "--check-seq-lens"]


def generate(server: Server, bodies: list[dict]) -> list[list[int]]:
    """Sends the requests concurrently (so they share batches); returns their output ids."""
    http = server.http()

    def one(body: dict) -> list[int]:
        r = http.post("/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(one, bodies))


def greedy_texts(server: Server, max_new: int = 20) -> list[list[int]]:
    params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    return generate(server, [{"text": t, "sampling_params": params} for t in TEXTS])


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_server) -> list[list[int]]:
    return greedy_texts(smollm2_server)


def test_smollm2_tp3_greedy_equals_tp1(smollm2_reference):
    with running_server([*SMOLLM2_FLAGS, "--tp-size", "3"]) as server:
        assert greedy_texts(server) == smollm2_reference
        log = server.log_tail(400)
    for rank, (h, kv) in enumerate([("0-2", "0-0"), ("3-5", "1-1"), ("6-8", "2-2")]):
        assert f"tp{rank}/3: heads {h}, KV heads {kv}," in log


def test_smollm2_tp2_splits_heads_unevenly_and_replicates_a_kv_head(smollm2_reference):
    """9 heads and 3 KV heads do not split by 2: rank 0 takes heads 0-3 (KV heads 0-1), rank 1
    heads 4-8 (KV heads 1-2); KV head 1 serves both ranks, so it lives on both."""
    with running_server([*SMOLLM2_FLAGS, "--tp-size", "2"]) as server:
        assert greedy_texts(server) == smollm2_reference
        log = server.log_tail(400)
    assert "tp0/2: heads 0-3, KV heads 0-1," in log
    assert "tp1/2: heads 4-8, KV heads 1-2," in log


def random_model_bodies() -> list[dict]:
    greedy = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    seeded = {"max_new_tokens": 32, "temperature": 0.8, "top_p": 0.9, "seed": 7, "ignore_eos": True}
    prompts = [[200 + 13 * i + j for j in range(3 + 11 * i)] for i in range(5)]  # 3..47 tokens: chunked
    return [{"input_ids": p, "sampling_params": greedy} for p in prompts] + [
        {"input_ids": prompts[1], "sampling_params": seeded}
    ]


@pytest.fixture(scope="module")
def random_model_reference(fault_server) -> list[list[int]]:
    return generate(fault_server, random_model_bodies())


@pytest.fixture(scope="module")
def tp2_server(fault_model):
    """The random-weight model at tp 2 (2 heads and 1 KV head a rank), shared by the output
    test and, after it, the rank-1 SIGKILL test."""
    with running_server(["--model", fault_model, *RANDOM_FLAGS, "--tp-size", "2"]) as server:
        yield server


@pytest.mark.parametrize("tp", [2, 4])
def test_random_model_greedy_and_seeded_equal_tp1(tp, fault_model, random_model_reference, request):
    """At tp 4 each rank has one head, and each KV head is replicated on two ranks."""
    with ExitStack() as stack:
        if tp == 2:
            server = request.getfixturevalue("tp2_server")
        else:
            server = stack.enter_context(running_server(["--model", fault_model, *RANDOM_FLAGS, "--tp-size", str(tp)]))
        assert generate(server, random_model_bodies()) == random_model_reference


def test_more_ranks_than_heads_is_a_one_line_startup_error(fault_model):
    res = subprocess.run(
        [sys.executable, "launch.py", "--model", fault_model, "--tp-size", "5", "--dtype", "float32"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode != 0
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.stderr[-3000:]
    assert re.search(r"--tp-size 5 cannot split the model's 4 attention heads \(2 KV heads\)", errors[0])


def kill_rank1(server: Server) -> None:
    child(server, "trident::worker[tp1]").send_signal(signal.SIGKILL)


def test_sigkill_of_rank1_mid_generation_restarts_the_group_with_unchanged_output(tp2_server, fault_reference):
    server = tp2_server
    before = {p.pid for p in server.process_tree()}
    assert run_with_fault(server, kill_rank1) == fault_reference
    after = {p.pid for p in server.process_tree()}
    assert len(before - after) == 2  # both ranks were replaced, nothing else
    assert "trident_restarts_total 1.0" in server.http().get("/metrics").text
    ports = re.findall(r"joined the gloo group as rank 0 of 2 \(store 127\.0\.0\.1:(\d+)\)", server.log_tail(2000))
    assert len(ports) == 2 and ports[0] != ports[1]  # the new group met on a fresh port


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 4), (4, 2), (8, 1)])
def test_every_head_and_vocab_row_is_somewhere_and_each_rank_has_the_kv_its_heads_read(heads, kv_heads):
    cfg = ModelConfig(
        vocab_size=1001,
        hidden_size=64,
        intermediate_size=50,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=8,
    )
    group = heads // kv_heads
    for size in range(1, heads + 1):
        plans = [ShardPlan.build(cfg, r, size) for r in range(size)]
        assert [h for p in plans for h in range(*p.heads)] == list(range(heads))
        assert [i for p in plans for i in range(*p.intermediate)] == list(range(50))
        assert [v for p in plans for v in range(*p.vocab)] == list(range(1001))
        assert len({p.vocab_rows for p in plans}) == 1
        for p in plans:
            assert [p.kv_heads[0] + k for k in p.kv_of_head] == [h // group for h in range(*p.heads)]
            assert p.num_kv_heads == len(set(p.kv_of_head))


RANK_SCRIPT = textwrap.dedent("""
    import sys, time, torch
    from gpu_worker.runtime.parallel import TPGroup
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    tp = TPGroup.init(rank, 2, torch.device("cpu"), port, timeout_s=3)
    print("agree:", tp.check_step(5, failed=False), flush=True)
    print("skew:", tp.check_step(5 + rank, failed=False), flush=True)
    print("failed:", tp.check_step(6, failed=rank == 1), flush=True)
    if rank == 1:
        time.sleep(15)  # alive but never meets rank 0 again
    else:
        t0 = time.monotonic()
        try:
            tp.check_step(7, failed=False)
        except Exception as e:
            print(f"timed out after {time.monotonic() - t0:.0f} s: {type(e).__name__}", flush=True)
""")


def test_ranks_detect_a_step_mismatch_and_a_silent_peer_times_out():
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(r), str(port)],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        out0 = procs[0].communicate(timeout=60)[0]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert "agree: None" in out0
    assert "skew: tensor-parallel ranks disagree on the step id (steps 5 to 6)" in out0
    assert "failed: a tensor-parallel rank could not apply step 6" in out0
    assert re.search(r"timed out after [3-9] s", out0), out0
