"""--dp-size 2 on a local two-node Ray cluster (tests/ray_cluster.py): one replica on each
node, the router unchanged, and transformers' float32 greedy text from both; a SIGTERM
stops the launcher cleanly and takes the workers on Ray's nodes with it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.family_models import transformers_greedy
from tests.helpers import running_server, wait_until
from tests.ray_cluster import local_ray_cluster, node_ids, ray_flags, worker_nodes, worker_pids
from tests.workload import BASE

pytest.importorskip("ray")

MAX_NEW = 16


def test_dp2_places_one_replica_on_each_ray_node_and_serves_through_both(fault_model):
    prompts = [[101 + i, 2054, 374, 279, 6864 + i] for i in range(4)]
    reference = [transformers_greedy(fault_model, p, MAX_NEW) for p in prompts]
    with local_ray_cluster(worker_nodes=2) as cluster:
        before = worker_pids()
        with running_server(["--model", fault_model, *BASE, "--dp-size", "2", *ray_flags(cluster)]) as server:
            params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
            with ThreadPoolExecutor(len(prompts)) as pool, server.http() as http:
                body = [{"input_ids": p, "sampling_params": params} for p in prompts]
                responses = list(pool.map(lambda b: http.post("/generate", json=b), body))
            assert [r.json()["output_ids"] for r in responses] == reference
            replicas = server.http().get("/server_info").json()["replicas"]
            assert [r["routed_requests"] for r in replicas] == [2, 2]
            placed = worker_nodes(server)
            assert len(node_ids(placed[0] + placed[1])) == 2  # each replica on a node of its own
            ours = worker_pids() - before
            assert len(ours) == 2
        assert server.proc.returncode == 0  # SIGTERM drained and stopped it (not Ray's own handler)
        # This server's workers go with their actors, which Ray's GCS kills asynchronously once
        # the launcher (their driver) has gone; the bound is generous for a busy host.
        assert wait_until(lambda: not (worker_pids() & ours), 120)
