"""Node 0's view of the other nodes of a multi-node server: which are there, which are missing.

Every other node's launcher (node_agent.py) says `NodeHello` every HEARTBEAT_INTERVAL_S for
as long as it runs. Node 0 calls a node missing once it has not heard from it for
NODE_SILENCE_S (a machine that died, a launcher SIGKILLed with its process group, a cut
network): waiting out a torch.distributed rendezvous for a rank that will never come is
what this replaces. A hello from a launcher with a new pid, or from a node that was
missing, is a rejoin: its ranks are gone (or were stopped) and must be started again.
"""

from __future__ import annotations

import time
from collections.abc import Callable

HEARTBEAT_INTERVAL_S = 1.0
NODE_SILENCE_S = 4.0
"""Four missed heartbeats: long enough for a loaded machine, short enough that /health and
new requests learn of the loss within seconds."""


class NodeWatch:
    def __init__(self, nnodes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.others = range(1, nnodes)
        self.last_heard: dict[int, float] = {}
        self.launcher_pids: dict[int, int] = {}
        self.missing: set[int] = set()

    def hello(self, node: int, pid: int) -> bool:
        """Records a hello; True when it is a rejoin (a new launcher, or a node that was missing)."""
        known = self.launcher_pids.get(node)
        rejoin = node in self.missing or (known is not None and known != pid)
        self.launcher_pids[node] = pid
        self.heard(node)
        self.missing.discard(node)
        return rejoin

    def heard(self, node: int) -> None:
        self.last_heard[node] = self.clock()

    def newly_missing(self) -> list[int]:
        """Nodes silent for NODE_SILENCE_S that were not missing yet (now they are)."""
        now = self.clock()
        lost = [n for n in self.others if n not in self.missing and now - self.last_heard.get(n, now) > NODE_SILENCE_S]
        self.missing.update(lost)
        return lost

    def describe_missing(self) -> str:
        """How the server's health names the missing nodes."""
        nodes = ", ".join(str(n) for n in sorted(self.missing))
        return f"node {nodes} is missing (no word from its launcher for over {NODE_SILENCE_S:.0f} s)"
