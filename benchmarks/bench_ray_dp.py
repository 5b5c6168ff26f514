"""--dp-size 2 placed by Ray over two nodes against two local replicas, as one ratio.

    python benchmarks/bench_ray_dp.py --dtype bfloat16 --concurrency 32 --output-len 128
    python benchmarks/bench_ray_dp.py --ray-address HEAD:6379   # an existing Ray cluster

Starts trident twice on the default SmolLM2: `--dp-size 2` as today (both replicas under
this launcher), then `--dp-size 2 --distributed-executor ray` on a Ray cluster of two
worker nodes, and runs the same streaming workload through bench_serving's client against
each. Without --ray-address the cluster is ray.cluster_utils.Cluster on this machine: a
head with no CPU and two nodes of --node-cpus each, so each replica gets a node of its own
and the difference measured is what Ray's placement and the signed tcp links cost. The
goal (docs/ray.md) is a ratio of at least 0.9.
"""

from __future__ import annotations

import os
import sys
from contextlib import ExitStack

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_overlap_spec import comparison_parser, fixed_length_workload, log_dir_of, run_config  # noqa: E402
from serving_report import print_and_write_report  # noqa: E402

GOAL_RATIO = 0.9


def local_two_node_cluster(stack: ExitStack, node_cpus: int) -> str:
    """A Ray cluster of two worker nodes on this machine; its address."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    stack.callback(cluster.shutdown)
    for _ in range(2):
        cluster.add_node(num_cpus=node_cpus)
    return cluster.address


def main(argv: list[str] | None = None) -> int:
    p = comparison_parser(__doc__, "benchmarks/results/ray_dp.json")
    p.add_argument("--ray-address", default=None, help="an existing Ray cluster; else two nodes on this machine")
    p.add_argument("--node-cpus", type=int, default=1, help="CPUs each local Ray node offers")
    ns = p.parse_args(argv)
    log_dir = log_dir_of(ns)
    base = (
        f"python launch.py --dtype {ns.dtype} --max-total-tokens 65536 --max-running-requests 64 --dp-size 2 {ns.extra}"
    )
    requests = fixed_length_workload(ns)
    with ExitStack() as stack:
        address = ns.ray_address or local_two_node_cluster(stack, ns.node_cpus)
        local = run_config("local_dp2", base, requests, ns.concurrency, log_dir)
        ray_flags = f"--distributed-executor ray --ray-address {address} --ray-placement spread"
        on_ray = run_config("ray_dp2", f"{base} {ray_flags}", requests, ns.concurrency, log_dir)
    ratio = on_ray["output_tok_s"] / local["output_tok_s"]
    report = {
        "runs": [local, on_ray],
        "ray_to_local_ratio": ratio,
        "goal_ratio": GOAL_RATIO,
        "meets_goal": ratio >= GOAL_RATIO,
        "ray_address": ns.ray_address or "local ray.cluster_utils.Cluster, 2 nodes",
        "cpu_count": os.cpu_count(),
        "loadavg": os.getloadavg(),
    }
    print_and_write_report(report, ns.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
