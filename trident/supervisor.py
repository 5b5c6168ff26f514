"""Starting, supervising, restarting and stopping trident's processes (used by launch.py).

Supervision waits on process sentinels (pidfds) and on the control socket together; it
never polls with sleeps. What a death costs:

    worker (any rank, on any node) dies, or its scheduler reports it hung
        -> SIGKILL that replica's whole TP group (other nodes are told to do the same), start
           it again; the scheduler requeues its running requests as prefills of prompt +
           output (WorkerGroupLost tells it, unless it asked). Other replicas keep serving.
    scheduler dies -> start it again; it resets the workers' batches and announces a new
           boot_id, and the tokenizer resubmits the requests it had sent to that replica
    tokenizer dies -> start it again; its HTTP connections are lost, the scheduler frees
           their work when the new tokenizer says hello

restart_policy.py decides what a death costs: a process that served for a while is
restarted at once, one that dies before or soon after it is ready waits (backoff) and
counts against the budget; restart_queue.py holds the restarts waiting out their backoff.
Past the budget the supervisor gives up: the tokenizer fails open requests with a clear
error, then (`--on-give-up exit`, the default) the launcher exits with EXIT_GAVE_UP so that
systemd, Kubernetes or a shell loop starts it afresh, or (`stay`) it stays up answering 503.

Across nodes, node 0 talks to the other nodes' launchers through node_link.py, and
node_watch.py notices a node whose launcher went silent: while it is missing no worker
group is started (its ranks cannot come), the tokenizer answers 503 naming it, and when its
launcher says hello again every group is started anew.

With --distributed-executor ray, Ray places each worker group (ray_workers.py) and reports
its death, which costs what a worker's death costs here; a group Ray cannot place yet
makes the tokenizer answer 503 naming the missing resources until Ray places it.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from trident.child_process import Child, free_port
from trident.node_link import NodeLink, NodeRejoined
from trident.ray_events import GroupDied, GroupEvent, Placements
from trident.restart_policy import RestartPolicy
from trident.restart_queue import RestartQueue
from trident.wire.cluster import StartWorkerGroup, StopNode, WorkerGroupDied, layout_of, signer_of
from trident.wire.control import (
    WORKER_GENERATION_ENV,
    LauncherMessage,
    ProcessFailed,
    ProcessReady,
    RestartWorkers,
    check_protocol_version,
    process_name,
)
from trident.wire.frontend import ServerHealth, WorkerGroupLost
from trident.wire.server_args import ServerArgs
from trident.wire.transport import (
    ENDPOINT_LAUNCHER,
    ENDPOINT_TOKENIZER_IN,
    PullSocket,
    PushSocket,
    endpoint,
    scheduler_in_endpoint,
)

if TYPE_CHECKING:
    from trident.ray_workers import RayExecutor

logger = logging.getLogger("trident.launch")
STOP_GRACE_S = 5.0
EXIT_GAVE_UP = 3
"""launch.py's exit code after the restart budget ran out (--on-give-up exit)."""
DIST_PORT_ENV = "TRIDENT_DIST_INIT_PORT"
"""The worker group's torch.distributed rendezvous port, fresh for every generation."""


class StartupError(RuntimeError):
    pass


class Launcher:
    """Owns the children of one node's share of a server; the run directory belongs to the
    caller. On node 0 it also starts the schedulers and the tokenizer, and tells the other
    nodes' launchers (node_agent.py) when to start their ranks."""

    def __init__(self, args: ServerArgs, args_file: str) -> None:
        self.args = args
        self.args_file = args_file
        self.layout = layout_of(args)
        self.children: list[Child] = []
        self.zmq_ctx = zmq.Context()
        run = args.run_dir
        if self.layout.ranks_anywhere:  # Ray may place a worker on any node: it reports over signed tcp
            control = (self.layout.control_address(), True, LauncherMessage, "launcher", signer_of(args))
        else:
            control = (endpoint(run, ENDPOINT_LAUNCHER), True, LauncherMessage, "launcher")
        self.control = PullSocket(self.zmq_ctx, *control)
        self.to_schedulers: list[PushSocket] = []
        if args.node_rank == 0:
            self.to_schedulers = [
                PushSocket(self.zmq_ctx, endpoint(run, scheduler_in_endpoint(d)), bind=False)
                for d in range(args.dp_size)
            ]
        self.to_tokenizer: PushSocket | None = None
        self.nodes: NodeLink | None = None
        """Node 0's line to the other nodes' launchers (multi-node only)."""
        self.policy = RestartPolicy(args.max_restarts, args.restart_window_s)
        self.restarts = RestartQueue(self.policy, args.on_give_up, self._tell_tokenizer)
        """Every restart goes through it: now, after its backoff, or not at all once it gave up."""
        self.worker_generations = [0] * args.dp_size
        self.stop_requested: Callable[[], bool] = lambda: False
        """Set by launch.py to its signal flag: a start-up wait gives up when it turns true."""
        self.signal_wakeup: socket.socket | None = None
        """Set by launch.py: readable when a signal arrived (signal.set_wakeup_fd)."""
        self.ray: RayExecutor | None = None
        """Places, starts and watches the worker groups with --distributed-executor ray."""
        if self.layout.ranks_anywhere:
            from trident.ray_workers import RayExecutor

            self.ray = RayExecutor(args, args_file)
        self.placements = Placements(args.dp_size)
        """Where Ray placed each worker group, or what it lacks to place it (empty without Ray)."""

    # ------------------------------------------------------------------ start

    def spawn(self, role: str, rank: int = 0, dp_rank: int = 0, env: dict[str, str] | None = None) -> Child:
        args = self.args
        child = Child.start(role, rank, dp_rank, self.args_file, args.run_dir, args.dp_size, env or {})
        self.children.append(child)
        self.policy.started((role, dp_rank))
        return child

    def next_store_port(self, dp_rank: int) -> int:
        """Replica `dp_rank`'s rendezvous port for its next generation: the fixed port of
        --dist-init-addr the first time, then a fresh one, so that a restarted group never
        meets the previous one's store."""
        if self.worker_generations[dp_rank] == 0 and self.layout.base_port:
            return self.layout.store_port(dp_rank)
        return free_port(self.args.dist_init_host)

    def spawn_workers(self, dp_rank: int, told: StartWorkerGroup | None = None) -> None:
        """This node's ranks of one replica: of the generation node 0 `told` this node to
        start, or, on node 0 (None), of a new generation, which the other nodes are told."""
        if told is None:
            store_port = self.next_store_port(dp_rank)
            self.worker_generations[dp_rank] += 1
            told = StartWorkerGroup(dp_rank, self.worker_generations[dp_rank], store_port)
            if self.nodes is not None:
                self.nodes.tell(told)
        if self.ray is not None:
            self.policy.started(("worker", dp_rank))
            self.ray.start_group(dp_rank, told.generation)
            return
        env = {WORKER_GENERATION_ENV: str(told.generation)}
        if self.args.tp_size > 1:
            env[DIST_PORT_ENV] = str(told.store_port)
        for rank in self.layout.local_ranks():
            self.spawn("worker", rank, dp_rank, env)

    def start_all(self, with_tokenizer: bool = True) -> None:
        if self.layout.multi_node:
            self.wait_for_nodes()
        for d in range(self.args.dp_size):
            self.spawn_workers(d)
            self.spawn("scheduler", 0, d)
        expected = {("worker", r, d) for r in self.layout.local_ranks() for d in range(self.args.dp_size)} | {
            ("scheduler", 0, d) for d in range(self.args.dp_size)
        }
        if with_tokenizer:
            # Started with the others: it loads its tokenizer (slow for a GGUF not yet in the
            # cache) while the workers load the model, and its handshake waits for the schedulers.
            self.spawn("tokenizer")
            expected.add(("tokenizer", 0, 0))
        self.wait_ready(expected)
        if with_tokenizer:
            self.to_tokenizer = PushSocket(self.zmq_ctx, endpoint(self.args.run_dir, ENDPOINT_TOKENIZER_IN), False)
            if self.ray is not None:
                self._tell_tokenizer("")  # where Ray placed the ranks, for /server_info

    def wait_for_nodes(self) -> None:
        """Node 0: bind the signed control port and wait until every other node says hello."""
        self.nodes = NodeLink(self.zmq_ctx, self.args, self.layout)
        silent = self.nodes.wait_for_hellos(self.args.startup_timeout_s, self._check_not_stopped)
        if silent:
            raise StartupError(f"nodes {sorted(silent)} did not connect within {self.args.startup_timeout_s:.0f} s")

    def wait_ready(self, expected: set[tuple[str, int, int]]) -> None:
        deadline = time.monotonic() + self.args.startup_timeout_s
        while expected:
            self._check_not_stopped()
            for child in self.children:
                if child.proc.poll() is not None and (child.role, child.rank, child.dp_rank) in expected:
                    msg = self.control.recv(timeout_ms=500)  # a ProcessFailed may still be queued
                    if isinstance(msg, ProcessFailed):
                        raise StartupError(msg.error)
                    raise StartupError(f"{child.name} exited with code {child.proc.returncode} during start-up")
            if time.monotonic() > deadline:
                names = ", ".join(process_name(r, k, d, self.args.dp_size) for r, k, d in sorted(expected))
                raise StartupError(f"{names} did not report ready within {self.args.startup_timeout_s:.0f} s")
            for event in self._ray_events():
                if isinstance(event, GroupDied):
                    raise StartupError(event.cause)
                self._on_ray_event(event)
            msg = self.control.recv(timeout_ms=200)
            if isinstance(msg, ProcessFailed):
                raise StartupError(msg.error)
            if isinstance(msg, ProcessReady):
                self._log_ready(msg)
                expected.discard((msg.role, msg.rank, msg.dp_rank))

    def _check_not_stopped(self) -> None:
        if self.stop_requested():
            raise StartupError("stopped by a signal during start-up")

    def _log_ready(self, msg: ProcessReady) -> None:
        check_protocol_version(msg.role, msg.protocol_version)
        name = process_name(msg.role, msg.rank, msg.dp_rank, self.args.dp_size)
        logger.info("%s ready (pid %d) %s", name, msg.pid, msg.detail)
        self.policy.ready((msg.role, msg.dp_rank))

    # ------------------------------------------------------------------ supervise

    def supervise(self, stop_requested) -> int:
        """Restarts what dies until a stop is requested; returns the exit code."""
        while not stop_requested():
            poller = zmq.Poller()
            poller.register(self.control.sock, zmq.POLLIN)
            if self.nodes is not None:
                poller.register(self.nodes.sock, zmq.POLLIN)
            for child in self.children:
                poller.register(child.sentinel, zmq.POLLIN)
            if self.signal_wakeup is not None:
                poller.register(self.signal_wakeup, zmq.POLLIN)
            if self.ray is not None:
                poller.register(self.ray.wakeup, zmq.POLLIN)
            events = dict(poller.poll(self.restarts.poll_ms()))
            if stop_requested():
                break  # children dying now are being stopped, not failing
            # zmq's poller keys a plain socket's events by its file descriptor.
            if self.signal_wakeup is not None and self.signal_wakeup.fileno() in events:
                self.signal_wakeup.recv(4096)  # a signal that asks for no stop
            if self.control.sock in events:
                for msg in self.control.recv_nowait():
                    self._on_control(msg)
            if self.nodes is not None:
                for heard in self.nodes.receive() if self.nodes.sock in events else []:
                    self._on_node_message(heard)
                for node in self.nodes.watch.newly_missing():
                    self._on_node_missing(node)
            for child in [c for c in self.children if c.sentinel in events]:
                if child in self.children:
                    self._on_death(child)
            if self.ray is not None and self.ray.wakeup.fileno() in events:
                for event in self._ray_events():
                    self._on_ray_event(event)
            self.restarts.start_due()
            if self.restarts.gave_up and (self.args.on_give_up == "exit" or not self._has("tokenizer")):
                return EXIT_GAVE_UP  # nothing is left to answer HTTP, or the operator asked to exit
        return 0

    def _has(self, role: str) -> bool:
        return any(c.role == role for c in self.children)

    def _on_control(self, msg) -> None:
        if isinstance(msg, ProcessReady):
            self._log_ready(msg)
        elif isinstance(msg, ProcessFailed):
            logger.error("%s", msg.error)
        elif isinstance(msg, RestartWorkers):
            logger.error("scheduler of replica %d asks for a worker restart: %s", msg.dp_rank, msg.reason)
            self._restart_workers(msg.dp_rank, msg.reason, scheduler_knows=True)

    def _missing_nodes(self) -> set[int]:
        return self.nodes.watch.missing if self.nodes is not None else set()

    def _on_node_message(self, msg: NodeRejoined | WorkerGroupDied) -> None:
        if isinstance(msg, NodeRejoined):
            self._on_node_rejoined(msg.node, msg.was_missing)
        else:
            if msg.generation != self.worker_generations[msg.dp_rank]:
                return  # a rank of a group already being replaced, dying with its peers
            self._restart_workers(msg.dp_rank, f"node {msg.node_rank}: {msg.cause}", scheduler_knows=False)

    def _on_node_missing(self, node: int) -> None:
        """Stop every group (each spans all nodes) and answer 503 until the node is back."""
        cause = self.nodes.watch.describe_missing()
        logger.error("%s: stopping the worker groups until it rejoins", cause)
        for d in range(self.args.dp_size):
            self._drop_worker_group(d, cause)
        self._tell_tokenizer(cause)

    def _on_node_rejoined(self, node: int, was_missing: bool) -> None:
        """A node's launcher (re)started, or a missing node is heard again: its ranks are gone,
        so every group starts anew, once no node is missing any more."""
        cause = f"node {node} rejoined" if was_missing else f"node {node}'s launcher restarted"
        logger.warning("%s", cause)
        if self._missing_nodes() or self.restarts.gave_up:
            return
        for d in range(self.args.dp_size):
            self._drop_worker_group(d, cause)
            self.spawn_workers(d)
        self._tell_tokenizer(cause)

    def _drop_worker_group(self, dp_rank: int, cause: str) -> None:
        """Stops replica `dp_rank`'s group outside the restart policy (a node left or came
        back): no restart of it waits any more, and its scheduler requeues what it ran."""
        self.restarts.cancel(("worker", dp_rank))
        self.stop_workers(dp_rank)
        self.to_schedulers[dp_rank].send(WorkerGroupLost(cause, self.worker_generations[dp_rank]))

    def _ray_events(self) -> list[GroupEvent]:
        return self.ray.drain() if self.ray is not None else []

    def _on_ray_event(self, event: GroupEvent) -> None:
        """A worker group placed, waiting for room, or dead (ray_workers.py)."""
        if event.generation != self.worker_generations[event.dp_rank]:
            return  # from a group already replaced
        if isinstance(event, GroupDied):
            self._restart_workers(event.dp_rank, event.cause, scheduler_knows=False)
        elif (cause := self.placements.record(event)) is not None:
            self._tell_tokenizer(cause)

    def _on_death(self, child: Child) -> None:
        child.proc.poll()
        cause = f"{child.name} (pid {child.proc.pid}) exited with code {child.proc.returncode}"
        logger.error("%s", cause)
        if child.role == "worker":
            self._restart_workers(child.dp_rank, cause, scheduler_knows=False)
            return
        self._forget(child)
        self.restarts.restart((child.role, child.dp_rank), cause, lambda: self.spawn(child.role, 0, child.dp_rank))

    def stop_workers(self, dp_rank: int) -> None:
        """SIGKILL this node's ranks of one replica and wait for them (with Ray: remove its
        placement group, whose actors take their workers with them)."""
        if self.ray is not None:
            self.ray.stop_group(dp_rank)
            self.placements.removed(dp_rank)
        for child in [c for c in self.children if c.role == "worker" and c.dp_rank == dp_rank]:
            if child.proc.poll() is None:
                child.proc.kill()
            child.proc.wait()
            self._forget(child)

    def _restart_workers(self, dp_rank: int, cause: str, scheduler_knows: bool) -> None:
        lost = self.worker_generations[dp_rank]  # before the restart below counts a new one
        self.stop_workers(dp_rank)
        if self._missing_nodes():
            return  # the group cannot form without the missing node; its rejoin starts it
        restarting = self.restarts.restart(("worker", dp_rank), cause, lambda: self.spawn_workers(dp_rank))
        if restarting and not scheduler_knows:
            self.to_schedulers[dp_rank].send(WorkerGroupLost(cause, lost))

    def _tell_tokenizer(self, cause: str) -> None:
        """The server's health after a restart, a give-up, a node's loss or return, or a
        worker group Ray cannot place or placed again."""
        unplaced = self.placements.missing()
        gave_up, missing = self.restarts.gave_up, self._missing_nodes()
        healthy = not gave_up and not missing and not unplaced
        if not gave_up and missing:
            cause = self.nodes.watch.describe_missing()
        elif not gave_up and unplaced:
            cause = unplaced
        nodes = self.placements.nodes() if self.ray is not None else []
        if self.to_tokenizer is not None:
            self.to_tokenizer.send(ServerHealth(healthy, self.policy.restarts, cause, rank_nodes=nodes))

    def _forget(self, child: Child) -> None:
        self.children.remove(child)
        os.close(child.sentinel)

    # ------------------------------------------------------------------ stop

    def stop_all(self) -> None:
        """The tokenizer first (it drains open requests), then everything else."""
        if self.nodes is not None:
            self.nodes.tell(StopNode("node 0 is stopping"))
        order = sorted(self.children, key=lambda c: c.role != "tokenizer")
        for child in order:
            if child.proc.poll() is None:
                child.proc.terminate()
            if child.role == "tokenizer":
                child.wait_or_kill(self.args.shutdown_timeout_s + STOP_GRACE_S)
        deadline = time.monotonic() + STOP_GRACE_S
        for child in order:
            child.wait_or_kill(max(0.0, deadline - time.monotonic()))
        for child in list(self.children):
            self._forget(child)
        if self.ray is not None:
            self.ray.close()
        for sock in (self.control, self.nodes, self.to_tokenizer, *self.to_schedulers):
            if sock is not None:
                sock.close()
        self.zmq_ctx.term()
