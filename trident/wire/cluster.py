"""Where each process of a data-parallel, tensor-parallel, multi-node server runs, and what
the launchers of different nodes tell each other.

Layout: `dp_size` replicas, each one scheduler plus `tp_size` worker ranks. Node 0 runs the
tokenizer, every scheduler and the first `tp_size / nnodes` ranks of every replica; node k
runs ranks [k * tp_size / nnodes, (k + 1) * tp_size / nnodes) of every replica. TP rank 0 (the
one that replies to the scheduler) is therefore always beside its scheduler.

Ports, all on the --dist-init-addr host (the only address cross-node traffic uses):
    base + 2d      torch.distributed store of replica d (first generation)
    base + 2d + 1  replica d's scheduler -> its ranks on other nodes (signed descriptors)
    base + 2 * dp  node 0's launcher <-> other nodes' launchers (signed control)
A restarted worker group rendezvous on a fresh port that node 0 chooses and sends along.

With --distributed-executor ray (`ranks_anywhere`) there is one launcher and no node
agents: Ray places every rank of every replica, rank 0 included, on any node, so every rank
is remote and every link a worker has is signed tcp to the head (--dist-init-addr):
    base + 2d + 1      replica d's scheduler -> its ranks (signed descriptors)
    base + 2 * dp      every child -> the launcher (ready, failed, restart requests)
    base + 2 * dp + 1 + d   replica d's rank 0 -> its scheduler (step results)
and each group rendezvous on a port of the node that holds its rank 0 (trident/ray_workers.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from trident.wire.signing import FrameSigner

if TYPE_CHECKING:
    from trident.wire.server_args import ServerArgs


class ClusterError(ValueError):
    pass


@dataclass(frozen=True)
class ClusterLayout:
    dp_size: int
    tp_size: int
    nnodes: int
    node_rank: int
    host: str
    base_port: int
    """0 on a single node: ports are then chosen free at start."""
    ranks_anywhere: bool = False
    """Ray places the ranks (--distributed-executor ray): none of them is beside its scheduler."""

    def __post_init__(self) -> None:
        if self.dp_size < 1 or self.tp_size < 1 or self.nnodes < 1:
            raise ClusterError("--dp-size, --tp-size and --nnodes must be at least 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ClusterError(f"--node-rank must be in [0, {self.nnodes}), not {self.node_rank}")
        if self.tp_size % self.nnodes:
            raise ClusterError(
                f"--tp-size {self.tp_size} does not split over --nnodes {self.nnodes}: each node runs "
                "an equal share of every replica's ranks"
            )
        if self.nnodes > 1 and not self.base_port:
            raise ClusterError("--nnodes > 1 needs --dist-init-addr HOST:PORT")
        if self.ranks_anywhere and self.nnodes > 1:
            raise ClusterError("--distributed-executor ray places ranks on the Ray cluster's nodes: drop --nnodes")
        if self.ranks_anywhere and not self.base_port:
            raise ClusterError("--distributed-executor ray needs the head's ports (launch.py picks them)")

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    def local_ranks(self, node_rank: int | None = None) -> range:
        """TP ranks of every replica that run on `node_rank` (default: this node)."""
        node = self.node_rank if node_rank is None else node_rank
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def is_remote_rank(self, rank: int) -> bool:
        """Whether TP rank `rank` may run on another node than the schedulers (node 0)."""
        return self.ranks_anywhere or rank >= self.ranks_per_node

    def store_port(self, dp_rank: int) -> int:
        return self.base_port + 2 * dp_rank

    def descriptor_address(self, dp_rank: int) -> str:
        return f"tcp://{self.host}:{self.base_port + 2 * dp_rank + 1}"

    def control_address(self) -> str:
        return f"tcp://{self.host}:{self.base_port + 2 * self.dp_size}"

    def reply_address(self, dp_rank: int) -> str:
        """Replica `dp_rank`'s rank 0 -> its scheduler, when Ray places the ranks."""
        return f"tcp://{self.host}:{self.base_port + 2 * self.dp_size + 1 + dp_rank}"

    @property
    def port_count(self) -> int:
        """Ports from base_port up that the server binds."""
        return 2 * self.dp_size + 1 + (self.dp_size if self.ranks_anywhere else 0)


def parse_dist_init_addr(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterError(f"--dist-init-addr must be HOST:PORT, not {value!r}")
    return host.strip("[]"), int(port)


# ---------------------------------------------------------------------------- messages
# Between node 0's launcher and the others' (signed; see wire/signing.py).


class NodeHello(msgspec.Struct, array_like=True, tag="node_hello"):
    """From node k's launcher when it starts: it is ready to start its ranks when told."""

    node_rank: int
    pid: int
    protocol_version: int


class StartWorkerGroup(msgspec.Struct, array_like=True, tag="start_group"):
    """From node 0: (re)start your ranks of replica `dp_rank`, killing any still running.
    `store_port` is the group's torch.distributed rendezvous on the --dist-init-addr host."""

    dp_rank: int
    generation: int
    store_port: int


class WorkerGroupDied(msgspec.Struct, array_like=True, tag="group_died"):
    """From node k: one of its ranks of replica `dp_rank` exited; node 0 restarts the group
    unless `generation` is already older than the group's (its ranks die with their peers)."""

    node_rank: int
    dp_rank: int
    generation: int
    cause: str


class StopNode(msgspec.Struct, array_like=True, tag="stop_node"):
    """From node 0 when it stops: stop your workers and exit."""

    reason: str = ""


ClusterMessage = NodeHello | StartWorkerGroup | WorkerGroupDied | StopNode


def layout_of(args: ServerArgs) -> ClusterLayout:
    return ClusterLayout(
        args.dp_size,
        args.tp_size,
        args.nnodes,
        args.node_rank,
        args.dist_init_host,
        args.dist_init_port,
        args.distributed_executor == "ray",
    )


def signer_of(args: ServerArgs) -> FrameSigner:
    if not args.cluster_secret:
        raise ClusterError("a multi-node server needs a cluster secret")
    return FrameSigner(bytes.fromhex(args.cluster_secret))
