"""Node 0's link to the other nodes' launchers (multi-node only): the signed control port
they connect to, their hellos (node_watch.py keeps who is there and who is missing), the
orders node 0 sends (StartWorkerGroup, StopNode) and the deaths they report (WorkerGroupDied).

What node 0 does about a missing, rejoined or failing node is the supervisor's decision
(supervisor.py); this module only reads and writes the link.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import zmq

from trident.node_watch import NodeWatch
from trident.wire.cluster import (
    ClusterLayout,
    ClusterMessage,
    NodeHello,
    StartWorkerGroup,
    StopNode,
    WorkerGroupDied,
    signer_of,
)
from trident.wire.control import check_protocol_version
from trident.wire.server_args import ServerArgs
from trident.wire.transport import PeerSender, node_peer_id

logger = logging.getLogger("trident.launch")


@dataclass(frozen=True)
class NodeRejoined:
    """A hello that node_watch.py counts as a rejoin: the node's ranks are gone."""

    node: int
    was_missing: bool
    """False: the node was there, but its launcher restarted (a new pid)."""


class NodeLink:
    """Binds the signed control port on construction; the other launchers connect to it."""

    def __init__(self, zmq_ctx: zmq.Context, args: ServerArgs, layout: ClusterLayout) -> None:
        self.nnodes = args.nnodes
        self.address = layout.control_address()
        self.peers = PeerSender(zmq_ctx, self.address, signer_of(args), ClusterMessage, "launcher.nodes")
        self.watch = NodeWatch(args.nnodes)

    @property
    def sock(self) -> zmq.Socket:
        """Readable when another launcher said something: the supervisor polls it."""
        return self.peers.sock

    def wait_for_hellos(self, timeout_s: float, check_not_stopped: Callable[[], None]) -> set[int]:
        """Waits until every other node says hello; returns the nodes still silent after timeout_s."""
        waiting = set(range(1, self.nnodes))
        logger.info("waiting for nodes %s on %s", sorted(waiting), self.address)
        deadline = time.monotonic() + timeout_s
        while waiting and time.monotonic() <= deadline:
            check_not_stopped()
            if not self.peers.sock.poll(200):
                continue
            for _, msg in self.peers.recv_nowait():
                if isinstance(msg, NodeHello):
                    check_protocol_version(f"node {msg.node_rank}", msg.protocol_version)
                    if msg.node_rank in waiting:
                        logger.info("node %d connected (launcher pid %d)", msg.node_rank, msg.pid)
                    self.watch.hello(msg.node_rank, msg.pid)
                    waiting.discard(msg.node_rank)
        return waiting

    def receive(self) -> Iterator[NodeRejoined | WorkerGroupDied]:
        """What the other launchers said: a hello is recorded and yielded only when it is a
        rejoin; a worker group's death is yielded as it came. Lazy, so that the supervisor
        acts on each before the next one is recorded."""
        for peer, msg in self.peers.recv_nowait():
            if isinstance(msg, NodeHello):
                if node_peer_id(msg.node_rank) != peer:
                    continue  # one node speaking for another: a misconfigured --node-rank
                was_missing = msg.node_rank in self.watch.missing
                if self.watch.hello(msg.node_rank, msg.pid):
                    yield NodeRejoined(msg.node_rank, was_missing)
            elif isinstance(msg, WorkerGroupDied):
                self.watch.heard(msg.node_rank)
                yield msg

    def tell(self, msg: StartWorkerGroup | StopNode) -> None:
        """Sends `msg` to every other node's launcher; a node not connected misses it (logged)."""
        for node in range(1, self.nnodes):
            if not self.peers.send(node_peer_id(node), msg):
                logger.error("node %d is not connected: it missed %s", node, type(msg).__name__)

    def close(self) -> None:
        self.peers.close()
