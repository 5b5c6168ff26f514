"""`python -m tokenizer_proc --args-file F --parent-pid P`: the tokenizer process (started by launch.py).

Start-up, in order; any failure is reported to launch.py as one line and exits 1:
1. load the tokenizer;
2. open the sockets and handshake with the scheduler (TokenizerHello -> ServerInfo,
   protocol versions must match);
3. bind the HTTP port and start uvicorn in this process's single asyncio loop;
4. report ready with the URL once uvicorn is listening.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import time
from collections.abc import Generator

import uvicorn
import uvloop
import zmq.asyncio

from tokenizer_proc.app import create_app
from tokenizer_proc.metrics import Metrics
from tokenizer_proc.request_manager import RequestManager
from tokenizer_proc.state import FrontendState
from tokenizer_proc.tokenization import load_tokenizer
from trident.wire.child import ChildContext, start_child, tune_gc
from trident.wire.control import ProtocolMismatch

logger = logging.getLogger("tokenizer_proc")

GRACEFUL_SHUTDOWN_S = 2
KEEP_ALIVE_S = 75
"""How long an idle HTTP connection stays open. Longer than the clients' own idle expiry
(httpx, under the openai client: 5 s; aiohttp: 15 s), so the client is the one to close it:
with uvicorn's default of 5 s both ends gave up together, and a request sent on a connection
the server was closing failed with 'Server disconnected without sending a response'."""


class StartupError(Exception):
    """A start-up step failed; the message is the one line launch.py prints."""


class _Server(uvicorn.Server):
    """uvicorn, minus its SIGINT handling (launch.py handles Ctrl-C for the whole group), and
    ending open requests with "abort" before the graceful wait, so no stream is cut mid-event."""

    def __init__(self, config: uvicorn.Config, manager: RequestManager) -> None:
        super().__init__(config)
        self._manager = manager

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # Drain: admit nothing new, let open requests finish within the shutdown timeout.
        self._manager.draining = True
        deadline = time.monotonic() + self._manager.args.shutdown_timeout_s
        while self._manager.num_open and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        aborted = self._manager.abort_all()
        if aborted:
            logger.info("shutting down: aborted %d open requests", aborted)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        previous = signal.signal(signal.SIGTERM, self.handle_exit)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on connections whose
    # socket says TCP. With proto 0 each response's last small write waited for the client's
    # delayed ACK: every non-streamed response and every stream's end came a delayed-ACK
    # timeout late.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    sock.set_inheritable(True)
    return sock


async def _run(ctx: ChildContext) -> None:
    args = ctx.args
    sock = _bind(args.host, args.port)  # first: a taken port fails before any slow step
    try:
        tokenizer = load_tokenizer(args.tokenizer_source, without_torch=True, chat_template=args.chat_template)
    except Exception as e:
        raise StartupError(f"cannot load the tokenizer of {args.tokenizer_source}: {type(e).__name__}: {e}") from e

    zmq_ctx = zmq.asyncio.Context()
    metrics = Metrics()
    manager = RequestManager(zmq_ctx, args, tokenizer, metrics)
    metrics.attach_scheduler(
        lambda: manager.stats, lambda: manager.dropped_frames, manager.replicas, args.served_model_name
    )
    try:
        try:
            info = await manager.handshake(args.startup_timeout_s)
        except ProtocolMismatch as e:
            raise StartupError(str(e)) from e
        except asyncio.TimeoutError as e:
            raise StartupError(f"the scheduler did not answer the handshake within {args.startup_timeout_s:g}s") from e
        logger.info(
            "scheduler handshake done: context_length=%d vocab_size=%d max_running_requests=%d",
            info.context_length,
            info.vocab_size,
            info.max_running_requests,
        )
        manager.start()
        await _serve(ctx, sock, FrontendState(args, tokenizer, manager, metrics))
    finally:
        sock.close()
        await manager.close()
        zmq_ctx.term()


async def _serve(ctx: ChildContext, sock: socket.socket, state: FrontendState) -> None:
    args = ctx.args
    config = uvicorn.Config(
        create_app(state),
        log_config=None,  # keep start_child's logging format
        log_level=args.log_level.lower(),
        access_log=args.log_level.lower() == "debug",
        lifespan="off",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    server = _Server(config, state.manager)

    async def serve() -> None:
        try:
            await server.serve(sockets=[sock])
        except SystemExit as e:  # uvicorn exits on start-up failure; keep it a plain error
            raise StartupError(f"the HTTP server failed to start (exit {e.code})") from None

    task = asyncio.create_task(serve(), name="uvicorn")
    while not server.started:
        if task.done():
            task.result()
            raise StartupError("the HTTP server stopped before it started listening")
        await asyncio.sleep(0.02)
    tune_gc()
    url = f"http://{args.host}:{args.port}"
    logger.info("serving %s at %s", args.served_model_name, url)
    ctx.report_ready(url)
    await task


def main() -> None:
    ctx = start_child("tokenizer")
    try:
        # uvloop (and httptools, which uvicorn picks when it is installed) cut this process's
        # CPU per step (docs/benchmarks.md, "Method"): on a CPU-only machine that CPU is
        # taken from the worker's cores.
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(_run(ctx))
    except StartupError as e:
        logger.error("%s", e)
        ctx.report_failed(str(e))
        sys.exit(1)
    except Exception as e:
        logger.exception("tokenizer process failed")
        ctx.report_failed(f"{type(e).__name__}: {e}")
        sys.exit(1)


if __name__ == "__main__":
    main()
