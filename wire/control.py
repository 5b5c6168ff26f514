"""Start-up and supervision messages: children -> launch.py, and the version handshake.

Every child pushes one `ProcessReady` (or `ProcessFailed`) to launch.py's control socket.
The first message a worker sends the scheduler, and the first the tokenizer sends the
scheduler, carry `PROTOCOL_VERSION`; a mismatch stops start-up with a clear error.
"""

from __future__ import annotations

import msgspec

PROTOCOL_VERSION = 1
"""Bump whenever any struct in wire/ changes shape."""


class ProtocolMismatch(RuntimeError):
    pass


def check_protocol_version(peer: str, version: int) -> None:
    if version != PROTOCOL_VERSION:
        raise ProtocolMismatch(
            f"{peer} speaks trident wire protocol v{version}, this process speaks "
            f"v{PROTOCOL_VERSION}: start every process from the same checkout"
        )


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


class ProcessFailed(msgspec.Struct, array_like=True, tag="failed"):
    """A child could not start; `error` is the one-line reason launch.py prints."""

    role: str
    rank: int
    pid: int
    error: str


class RestartWorkers(msgspec.Struct, array_like=True, tag="restart_workers"):
    """From the scheduler: the workers stopped making progress (watchdog); restart them."""

    reason: str


LauncherMessage = ProcessReady | ProcessFailed | RestartWorkers
