"""What a worker group placed by Ray tells the supervisor (ray_workers.py posts them), and
the supervisor's record of where each group stands (Placements).

Kept apart from ray_workers.py, which imports ray: the supervisor reads these whether or
not the optional `ray` package is installed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger("trident.launch")


@dataclass(frozen=True)
class GroupPlaced:
    """Ray placed the group and its workers started (they report ready themselves)."""

    dp_rank: int
    generation: int
    rank_nodes: list[str]
    """Where each rank runs: "<Ray node id> (<IP>)"."""


@dataclass(frozen=True)
class GroupUnplaced:
    """The group has waited for room longer than PLACEMENT_PATIENCE_S; posted again each
    time as long as it waits (a node that joins ends the wait)."""

    dp_rank: int
    generation: int
    missing: str
    """What the group needs and the cluster lacks, for /health."""


@dataclass(frozen=True)
class GroupDied:
    """A rank's worker exited, its actor died, or its node left: the group is lost."""

    dp_rank: int
    generation: int
    cause: str


GroupEvent = GroupPlaced | GroupUnplaced | GroupDied


class Placements:
    """Where Ray placed each replica's worker group, and which groups wait for room: owned
    by the supervisor, which reports both in the health it sends the tokenizer."""

    def __init__(self, dp_size: int) -> None:
        self.dp_size = dp_size
        self.unplaced: dict[int, str] = {}
        """Replicas whose worker group Ray cannot place now, and what it lacks."""
        self.rank_nodes: dict[int, list[str]] = {}
        """The Ray node of each rank of each placed replica (for the log and /server_info)."""

    def record(self, event: GroupPlaced | GroupUnplaced) -> str | None:
        """Records an event of a group's current generation; returns the cause to tell the
        tokenizer, or None when the event is no news (a group still waiting)."""
        d = event.dp_rank
        if isinstance(event, GroupPlaced):
            self.rank_nodes[d] = event.rank_nodes
            where = "; ".join(f"tp{r} on {node}" for r, node in enumerate(event.rank_nodes))
            logger.info("replica %d, generation %d, placed by Ray: %s", d, event.generation, where)
            self.unplaced.pop(d, None)
            return f"replica {d} placed by Ray: {where}"
        if d in self.unplaced:
            return None
        logger.error("%s; waiting for Ray to place it", event.missing)
        self.unplaced[d] = event.missing
        return event.missing

    def removed(self, dp_rank: int) -> None:
        """The replica's placement group was removed: its ranks are nowhere now."""
        self.rank_nodes.pop(dp_rank, None)

    def missing(self) -> str:
        """What the groups that wait for room lack; empty when none waits."""
        return "; ".join(self.unplaced[d] for d in sorted(self.unplaced))

    def nodes(self) -> list[list[str]]:
        """rank_nodes for every replica, empty for one not placed (ServerHealth.rank_nodes)."""
        return [self.rank_nodes.get(d, []) for d in range(self.dp_size)]
