"""A worker-only node of a multi-node server (`launch.py --nnodes N --node-rank K`, K > 0).

It runs this node's TP ranks of every replica and a health endpoint, nothing else: node 0
runs the tokenizer and the schedulers. Node 0 decides every start and restart; this node
obeys over the signed control link and reports deaths:

    StartWorkerGroup(d) from node 0 -> SIGKILL this node's ranks of replica d, start new ones
                                       (they rendezvous on the port the message names)
    one of our ranks of replica d dies -> SIGKILL its siblings here, tell node 0 (which
                                       restarts the whole group on every node)
    StopNode from node 0, SIGTERM    -> stop the workers and exit
    every HEARTBEAT_INTERVAL_S       -> NodeHello to node 0 (node_watch.py: silence means
                                       this node is missing; a new pid means it restarted)

GET /health on --host:--port answers 200 while every rank node 0 started here is alive,
else 503, with the counts (and the rejected-frame count of the control link) as JSON.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import zmq

from trident.node_watch import HEARTBEAT_INTERVAL_S
from trident.supervisor import Launcher
from trident.wire.cluster import ClusterMessage, NodeHello, StartWorkerGroup, StopNode, WorkerGroupDied, signer_of
from trident.wire.control import PROTOCOL_VERSION, ProcessFailed, ProcessReady
from trident.wire.transport import PeerConnection, node_peer_id

logger = logging.getLogger("trident.node")


class NodeAgent:
    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self.args = launcher.args
        self.node0 = PeerConnection(
            launcher.zmq_ctx,
            launcher.layout.control_address(),
            ClusterMessage,
            "node.control",
            signer_of(self.args),
            node_peer_id(self.args.node_rank),
        )
        self.generations: dict[int, int] = {}
        """Replica -> the generation of its group that node 0 last told this node to run."""
        self.health_server: ThreadingHTTPServer | None = None

    def health(self) -> tuple[int, dict]:
        alive = sum(1 for c in self.launcher.children if c.role == "worker" and c.proc.poll() is None)
        expected = len(self.generations) * len(self.launcher.layout.local_ranks())
        ok = bool(self.generations) and alive == expected
        body = {
            "node_rank": self.args.node_rank,
            "workers_alive": alive,
            "workers_expected": expected,
            "rejected_frames": self.node0.rejected,
            "status": "ok" if ok else "unavailable",
        }
        return (200 if ok else 503), body

    def serve_health(self) -> str:
        agent = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                code, body = agent.health() if self.path == "/health" else (404, {"error": "not found"})
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_args) -> None:
                pass

        self.health_server = ThreadingHTTPServer((self.args.host, self.args.port), Handler)
        threading.Thread(target=self.health_server.serve_forever, name="health", daemon=True).start()
        return f"http://{self.args.host}:{self.args.port}/health"

    def run(self, stop_requested: Callable[[], bool]) -> int:
        """The node's loop: say hello (and keep saying it), start what node 0 says, watch and report."""
        last_hello = 0.0
        while not stop_requested():
            if time.monotonic() - last_hello > HEARTBEAT_INTERVAL_S:
                self.node0.send(NodeHello(self.args.node_rank, os.getpid(), PROTOCOL_VERSION))
                last_hello = time.monotonic()
            poller = zmq.Poller()
            poller.register(self.node0.sock, zmq.POLLIN)
            poller.register(self.launcher.control.sock, zmq.POLLIN)
            for child in self.launcher.children:
                poller.register(child.sentinel, zmq.POLLIN)
            events = dict(poller.poll(500))
            if self.launcher.control.sock in events:
                for msg in self.launcher.control.recv_nowait():
                    if isinstance(msg, ProcessReady):
                        self.launcher._log_ready(msg)
                    elif isinstance(msg, ProcessFailed):
                        logger.error("%s", msg.error)
            for msg in self.node0.recv_nowait() if self.node0.sock in events else []:
                if isinstance(msg, StopNode):
                    logger.info("node 0 stops the server: %s", msg.reason)
                    return 0
                if isinstance(msg, StartWorkerGroup):
                    logger.info("starting replica %d, generation %d", msg.dp_rank, msg.generation)
                    self.launcher.stop_workers(msg.dp_rank)
                    self.launcher.spawn_workers(msg.dp_rank, msg)
                    self.generations[msg.dp_rank] = msg.generation
            for child in [c for c in self.launcher.children if c.sentinel in events]:
                if child not in self.launcher.children:
                    continue  # already stopped with its siblings
                cause = f"{child.name} (pid {child.proc.pid}) exited with code {child.proc.poll()}"
                logger.error("%s: stopping its group here and telling node 0", cause)
                self.launcher.stop_workers(child.dp_rank)
                self.node0.send(
                    WorkerGroupDied(self.args.node_rank, child.dp_rank, self.generations[child.dp_rank], cause)
                )
        return 0

    def close(self) -> None:
        if self.health_server is not None:
            self.health_server.shutdown()
        self.node0.close()
