"""A Ray cluster of several raylets on this machine (ray.cluster_utils.Cluster), for the
tests of --distributed-executor ray, and what they look for in it.

The head holds no CPU, so every worker rank lands on one of the worker nodes; each worker
node holds one CPU, so a tp 2 or dp 2 server needs both and the loss of one leaves a group
that cannot be placed until a node is added back.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

from tests.helpers import Server

WORKER_NODE_CPUS = 1


@contextmanager
def local_ray_cluster(worker_nodes: int = 2) -> Iterator:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for _ in range(worker_nodes):
            cluster.add_node(num_cpus=WORKER_NODE_CPUS)
        yield cluster
    finally:
        cluster.shutdown()


def ray_flags(cluster) -> list[str]:
    return ["--distributed-executor", "ray", "--ray-address", cluster.address]


def worker_processes() -> dict[str, psutil.Process]:
    """The workers of this test process's clusters by title (`trident::worker[tp1]`): under
    the raylets this process started, not under the launcher."""
    return dict(_titled_workers())


def worker_pids() -> set[int]:
    """The pids of this test process's clusters' workers (titles repeat across replicas)."""
    return {p.pid for _, p in _titled_workers()}


def _titled_workers() -> list[tuple[str, psutil.Process]]:
    found = []
    for p in psutil.Process(os.getpid()).children(recursive=True):
        try:
            title = " ".join(p.cmdline()).strip()
        except psutil.NoSuchProcess:
            continue
        if title.startswith("trident::worker"):
            found.append((title, p))
    return found


def worker_process(title: str) -> psutil.Process:
    found = worker_processes().get(title)
    assert found is not None, f"no {title} process under this test's Ray cluster"
    return found


def worker_nodes(server: Server) -> list[list[str]]:
    """The Ray node of each rank of each replica, as /server_info names them."""
    with server.http() as http:
        return [r["worker_nodes"] for r in http.get("/server_info").json()["replicas"]]


def node_ids(names: list[str]) -> set[str]:
    return {name.split()[0] for name in names}
