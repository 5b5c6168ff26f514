"""What every child process does at its boundary with launch.py.

`start_child` names the process (`trident::<role>`), ties its life to launch.py's
(parent-death signal plus a parent-pid watcher, so a SIGKILLed launcher leaves no
orphans), sets up logging, and opens the control socket used to report ready or failed.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import os
import signal
import threading
import time

import setproctitle
import zmq

from trident.wire.cluster import layout_of, signer_of
from trident.wire.control import PROTOCOL_VERSION, ProcessFailed, ProcessReady, RestartWorkers, process_name
from trident.wire.server_args import ServerArgs, load_server_args
from trident.wire.transport import ENDPOINT_LAUNCHER, PushSocket, endpoint

PR_SET_PDEATHSIG = 1
PARENT_CHECK_INTERVAL_S = 0.5
GC_GEN0_THRESHOLD = 50_000
"""Allocations between young-generation collections in the scheduler and the tokenizer
(Python's default is 700). Both allocate a few container objects per running request per
step (a row's token list, its queue item); at the default the cyclic collector ran several
times a step and took a large share of the scheduler's CPU at hundreds of running requests,
and most of the tokenizer's at thousands (docs/benchmarks.md, "Method"). Their own structures have
few cycles, so collecting rarely costs little memory."""


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux: the watcher thread below still covers it

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(PARENT_CHECK_INTERVAL_S)

    # The race between fork and prctl is closed by checking once right away.
    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def launcher_link(ctx: zmq.Context, args: ServerArgs) -> PushSocket:
    """The line to launch.py: its ipc socket, or, when Ray may place this process on another
    node, signed tcp to the head."""
    layout = layout_of(args)
    if layout.ranks_anywhere:
        return PushSocket(ctx, layout.control_address(), bind=False, signer=signer_of(args))
    return PushSocket(ctx, endpoint(args.run_dir, ENDPOINT_LAUNCHER), bind=False)


class ChildContext:
    """A started child: its args, role, and its line to launch.py."""

    def __init__(self, args: ServerArgs, role: str, rank: int, dp_rank: int = 0) -> None:
        self.args = args
        self.role = role
        self.rank = rank
        self.dp_rank = dp_rank
        """Which data-parallel replica this scheduler or worker belongs to."""
        self.zmq_ctx = zmq.Context()
        self._launcher = launcher_link(self.zmq_ctx, args)

    @property
    def name(self) -> str:
        return process_name(self.role, self.rank, self.dp_rank, self.args.dp_size)

    def report_ready(self, detail: str = "") -> None:
        self._launcher.send(ProcessReady(self.role, self.rank, os.getpid(), PROTOCOL_VERSION, detail, self.dp_rank))

    def tell_launcher(self, msg: RestartWorkers) -> None:
        self._launcher.send(msg)

    def report_failed(self, error: str) -> None:
        self._launcher.send(ProcessFailed(self.role, self.rank, os.getpid(), error, self.dp_rank))
        # Give the frame time to leave before the process exits (LINGER is 0).
        time.sleep(0.2)


def tune_gc() -> None:
    """Call once start-up is done: what it allocated (modules, tables, the tokenizer) is
    never garbage, so the collector stops walking it; then collect every ~50k allocations."""
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, 50, 100)


def start_child(role: str) -> ChildContext:
    """Parse the child command line (`--args-file`, `--parent-pid`, `--rank`) and set up."""
    parser = argparse.ArgumentParser(description=f"trident {role} process (started by launch.py)")
    parser.add_argument("--args-file", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--dp-rank", type=int, default=0)
    cli = parser.parse_args()
    _die_with_parent(cli.parent_pid)
    args = load_server_args(cli.args_file)
    title = "trident::" + process_name(role, cli.rank, cli.dp_rank, args.dp_size)
    setproctitle.setproctitle(title)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s {title} %(levelname)s %(message)s",
    )
    # launch.py handles Ctrl-C for the whole group; children shut down when told or killed.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return ChildContext(args, role, cli.rank, cli.dp_rank)
