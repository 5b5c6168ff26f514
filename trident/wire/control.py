"""Start-up and supervision messages: children -> launch.py, and the version handshake.

Every child pushes one `ProcessReady` (or `ProcessFailed`) to launch.py's control socket.
The first message a worker sends the scheduler, and the first the tokenizer sends the
scheduler, carry `PROTOCOL_VERSION`; a mismatch stops start-up with a clear error.
"""

from __future__ import annotations

import msgspec

PROTOCOL_VERSION = 9
"""Bump whenever any struct in wire/ changes shape."""

WORKER_GENERATION_ENV = "TRIDENT_WORKER_GENERATION"
"""Set by launch.py in every worker's environment: which start of its replica's worker group
the worker belongs to (1, 2, ... counted on node 0). The worker reports it in `WorkerReady`."""
DIST_HOST_ENV = "TRIDENT_DIST_INIT_HOST"
"""Set when Ray placed the ranks: the node of rank 0, where its group's torch.distributed
store listens (else the --dist-init-addr host)."""


class ProtocolMismatch(RuntimeError):
    pass


def check_protocol_version(peer: str, version: int) -> None:
    if version != PROTOCOL_VERSION:
        raise ProtocolMismatch(
            f"{peer} speaks trident wire protocol v{version}, this process speaks "
            f"v{PROTOCOL_VERSION}: start every process from the same checkout"
        )


def process_name(role: str, rank: int, dp_rank: int, dp_size: int) -> str:
    """How logs, titles and errors name a process: worker[tp1], scheduler[dp2], worker[dp2.tp1]."""
    replica = f"dp{dp_rank}" if dp_size > 1 else ""
    if role == "worker":
        return f"worker[{replica + '.' if replica else ''}tp{rank}]"
    if role == "scheduler" and replica:
        return f"scheduler[{replica}]"
    return role


class ProcessReady(msgspec.Struct, array_like=True, tag="ready"):
    """A child finished start-up. Written by the child, read by launch.py."""

    role: str
    """tokenizer | scheduler | worker"""
    rank: int
    """TP rank for workers, 0 otherwise."""
    pid: int
    protocol_version: int
    detail: str = ""
    """Human-readable facts for the start-up log (model, KV pool size...)."""
    dp_rank: int = 0
    """Data-parallel replica of a scheduler or worker; 0 for the tokenizer."""


class ProcessFailed(msgspec.Struct, array_like=True, tag="failed"):
    """A child could not start; `error` is the one-line reason launch.py prints."""

    role: str
    rank: int
    pid: int
    error: str
    dp_rank: int = 0


class RestartWorkers(msgspec.Struct, array_like=True, tag="restart_workers"):
    """From a scheduler: its workers stopped making progress (watchdog); restart them."""

    reason: str
    dp_rank: int = 0


LauncherMessage = ProcessReady | ProcessFailed | RestartWorkers
