"""tp 2 on a local multi-node Ray cluster (tests/ray_cluster.py), with real faults.

A tp 2 group spread over two Ray nodes gives transformers' float32 greedy text, and
/server_info and the log name the node of each rank. SIGKILL of a worker process mid-
generation restarts its group through Ray with the same text. Removing a node (its raylet
killed) turns /health to 503 naming the missing CPUs within 30 s, and no request hangs;
adding a node back serves the same text again, without restarting the server.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.family_models import transformers_greedy
from tests.helpers import running_server, wait_until
from tests.ray_cluster import WORKER_NODE_CPUS, local_ray_cluster, node_ids, ray_flags, worker_nodes, worker_process
from tests.workload import BASE, generation_tokens

pytest.importorskip("ray")

PROMPTS = [[101, 2054, 374, 279, 6864], [9906, 1917, 11, 856, 836, 374, 3523], [40, 1097, 264, 5818]]
MAX_NEW = 32
PARAMS = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster():
    with local_ray_cluster(worker_nodes=2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference(fault_model) -> list[list[int]]:
    return [transformers_greedy(fault_model, p, MAX_NEW) for p in PROMPTS]


@pytest.fixture(scope="module")
def tp2_server(cluster, fault_model):
    flags = ["--tp-size", "2", "--ray-placement", "spread", *ray_flags(cluster)]
    with running_server(["--model", fault_model, *BASE, *flags]) as server:
        yield server


def generate_all(server, timeout: float = 300) -> list[httpx.Response]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool, server.http() as http:
        body = [{"input_ids": p, "sampling_params": PARAMS} for p in PROMPTS]
        return list(pool.map(lambda b: http.post("/generate", json=b, timeout=timeout), body))


def outputs(responses: list[httpx.Response]) -> list[list[int]]:
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json()["output_ids"] for r in responses]


def test_tp2_spread_over_two_ray_nodes_equals_transformers_and_names_each_ranks_node(tp2_server, reference):
    assert outputs(generate_all(tp2_server)) == reference
    [ranks] = worker_nodes(tp2_server)
    assert len(ranks) == 2 and len(node_ids(ranks)) == 2  # spread: one rank on each node
    assert "placed by Ray: tp0 on " in tp2_server.log_tail(400)


def test_a_sigkilled_worker_restarts_its_group_through_ray_with_the_same_text(tp2_server, reference):
    before = generation_tokens(tp2_server)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(generate_all, tp2_server)
        assert wait_until(lambda: generation_tokens(tp2_server) > before + 8, 60)
        worker_process("trident::worker[tp1]").send_signal(signal.SIGKILL)
        assert outputs(running.result()) == reference
    log = "".join(tp2_server.output)
    assert "restarting after: worker[tp" in log and "no step progress" not in log  # Ray saw it, not the watchdog
    assert "generation 2, placed by Ray" in log
    assert len(worker_nodes(tp2_server)[0]) == 2  # /server_info names the new group's nodes


def test_removing_a_node_answers_503_within_30_s_and_a_node_added_back_serves_the_same_text(
    tp2_server, cluster, reference
):
    def health() -> httpx.Response:
        return tp2_server.http().get("/health")

    assert wait_until(lambda: health().status_code == 200, 60)
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(generate_all, tp2_server, 60)
        time.sleep(1.0)
        cluster.remove_node(cluster.worker_nodes.copy().pop(), allow_graceful=False)
        removed = time.monotonic()
        assert wait_until(lambda: health().status_code == 503, 30)
        assert time.monotonic() - removed < 30
        assert "CPU" in health().json()["reason"]  # names what Ray lacks to place the group
        statuses = {r.status_code for r in in_flight.result()}  # every request answered, none hangs
        assert statuses <= {200, 503}
    started = time.monotonic()
    refused = tp2_server.http().post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": PARAMS})
    assert refused.status_code == 503 and time.monotonic() - started < 5
    cluster.add_node(num_cpus=WORKER_NODE_CPUS)
    assert wait_until(lambda: health().status_code == 200, 180)
    assert outputs(generate_all(tp2_server)) == reference
