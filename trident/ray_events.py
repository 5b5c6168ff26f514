"""What a worker group placed by Ray tells the supervisor (ray_workers.py posts them).

Kept apart from ray_workers.py, which imports ray: the supervisor reads these whether or
not the optional `ray` package is installed.
"""

from __future__ import annotations

from dataclasses import dataclass


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
