"""Worker groups placed, started and watched by Ray (`--distributed-executor ray`).

The launcher stays on the head with the tokenizer and the schedulers; each replica's TP
group is one Ray placement group with a bundle per rank (its --cpu-threads CPUs, at least
one, and a GPU with --device cuda), on whichever nodes Ray finds room
(`--ray-placement pack|spread`). In each bundle a `RankHost` actor starts the same
`python -m gpu_worker` child as launch.py does on one node, on the actor's node, and waits
on it. The ranks talk to each other over torch.distributed and to the head over signed tcp
(wire/cluster.py): Ray carries no step.

    supervisor                  RayWorkerGroup thread               Ray
    start_group(d) ----------->  placement group ready? ----------> places the bundles
                                 (not within PLACEMENT_PATIENCE_S:   (a node added later
                                  GroupUnplaced, keeps waiting)       is used as it joins)
                                 RankHost per bundle, worker child
                <--------------  GroupPlaced(nodes of each rank)
                                 waits on every rank's child
                <--------------  GroupDied: a child exited, an actor died, a node left
    stop_group(d) ------------>  placement group removed: its actors die, and each child
                                 with its actor (parent-death signal, wire/child.py)

A GroupDied is the same fault as a worker's death on one node: the supervisor restarts the
group as a new placement group, wherever Ray can place it then. Events reach the
supervisor's poll through a socket pair, so it still waits on nothing but file descriptors.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import socket
import tempfile
import threading

import ray
from ray.exceptions import RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from trident.child_process import Child, free_port
from trident.ray_events import GroupDied, GroupEvent, GroupPlaced, GroupUnplaced
from trident.supervisor import DIST_PORT_ENV
from trident.wire.control import DIST_HOST_ENV, WORKER_GENERATION_ENV, process_name
from trident.wire.server_args import ServerArgs

logger = logging.getLogger("trident.ray")

PLACEMENT_PATIENCE_S = 3.0
"""How long a placement group may wait for room before /health says what is missing (Ray
places a group that fits in well under a second; one that waits longer lacks resources)."""
RAY_STRATEGY = {"pack": "PACK", "spread": "SPREAD"}


def connect(address: str | None) -> str:
    """Joins the Ray cluster at `address` (None: starts a local one); returns the head's IP,
    the address the workers on other nodes reach the schedulers and the launcher at."""
    if not ray.is_initialized():
        # ray.init installs its own SIGTERM handler; launch.py's drains and stops every child.
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        ray.init(address=address, log_to_driver=True, configure_logging=False)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return ray.util.get_node_ip_address()


def free_port_block(host: str, count: int) -> int:
    """The first of `count` consecutive ports free on `host`."""
    for _ in range(100):
        base = free_port(host)
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return base
    raise OSError(f"no {count} consecutive free ports on {host}")


@ray.remote(max_concurrency=4)
class RankHost:
    """One rank's actor: starts the worker process on its node and waits on it. Its calls
    run on threads of their own, so that `wait` blocking does not hold up the others."""

    def __init__(self, args_bytes: bytes) -> None:
        self.run_dir = tempfile.mkdtemp(prefix="trident-ray-")
        self.args_file = os.path.join(self.run_dir, "server_args.msgpack")
        with open(self.args_file, "wb") as f:
            f.write(args_bytes)
        self.child: Child | None = None

    def node(self) -> tuple[str, str]:
        """(Ray node id, IP) of the node holding this actor."""
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        return free_port(ray.util.get_node_ip_address())

    def start(self, rank: int, dp_rank: int, dp_size: int, env: dict[str, str]) -> int:
        self.child = Child.start("worker", rank, dp_rank, self.args_file, self.run_dir, dp_size, env)
        return self.child.proc.pid

    def wait(self) -> int:
        """Blocks until the worker exits; its exit code."""
        code = self.child.proc.wait()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return code


class RayWorkerGroup:
    """One generation of one replica's ranks; a thread follows it from placement to death."""

    def __init__(self, executor: RayExecutor, dp_rank: int, generation: int) -> None:
        self.executor = executor
        self.dp_rank = dp_rank
        self.generation = generation
        args = executor.args
        # A rank reserves the CPUs it computes on (--cpu-threads; one when unset, where the
        # worker shares the CPUs it sees among dp_size x tp_size workers, as on one node).
        cpus = float(max(1, args.cpu_threads))
        self.bundle = {"CPU": cpus, **({"GPU": 1.0} if args.device == "cuda" else {})}
        self.pg: PlacementGroup = placement_group(
            [dict(self.bundle) for _ in range(args.tp_size)], strategy=RAY_STRATEGY[args.ray_placement]
        )
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._follow, name=f"ray-group-{dp_rank}", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Removes the placement group, which kills its actors and so their workers."""
        self.stopped.set()
        try:
            remove_placement_group(self.pg)
        except RayError as e:  # the cluster itself is going away
            logger.warning("removing the placement group of replica %d: %s", self.dp_rank, e)

    def _post(self, event: GroupEvent) -> None:
        if not self.stopped.is_set():
            self.executor.post(event)

    def _follow(self) -> None:
        try:
            cause = self._place_start_and_wait()
        except RayError as e:
            cause = f"Ray: {type(e).__name__}: {e}"
        if cause is not None:
            self._post(GroupDied(self.dp_rank, self.generation, cause))

    def _place_start_and_wait(self) -> str | None:
        """The group's life; why it ended, or None when it was stopped."""
        ready = self.pg.ready()
        while not ray.wait([ready], timeout=PLACEMENT_PATIENCE_S)[0]:
            if self.stopped.is_set():
                return None
            self._post(GroupUnplaced(self.dp_rank, self.generation, self.describe_missing()))
        if self.stopped.is_set():
            return None
        args = self.executor.args
        actors = [
            RankHost.options(
                num_cpus=self.bundle["CPU"],
                num_gpus=self.bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank),
            ).remote(self.executor.args_bytes)
            for rank in range(args.tp_size)
        ]
        nodes = ray.get([a.node.remote() for a in actors])
        env = {WORKER_GENERATION_ENV: str(self.generation)}
        if args.tp_size > 1:
            env |= {DIST_HOST_ENV: nodes[0][1], DIST_PORT_ENV: str(ray.get(actors[0].free_port.remote()))}
        ray.get([a.start.remote(rank, self.dp_rank, args.dp_size, env) for rank, a in enumerate(actors)])
        self._post(GroupPlaced(self.dp_rank, self.generation, [f"{node_id} ({ip})" for node_id, ip in nodes]))
        waits = [a.wait.remote() for a in actors]
        done, _ = ray.wait(waits, num_returns=1)
        if self.stopped.is_set():
            return None
        rank = waits.index(done[0])
        name = process_name("worker", rank, self.dp_rank, args.dp_size)
        node_id, ip = nodes[rank]
        try:
            return f"{name} on Ray node {node_id} ({ip}) exited with code {ray.get(done[0])}"
        except RayError as e:
            return f"the Ray actor of {name} on node {node_id} ({ip}) died: {type(e).__name__}"

    def describe_missing(self) -> str:
        need = {k: v * len(self.pg.bundle_specs) for k, v in self.bundle.items()}
        have = {k: ray.cluster_resources().get(k, 0.0) for k in need}
        placement = self.executor.args.ray_placement
        return (
            f"the worker group of replica {self.dp_rank} cannot be placed on the Ray cluster: it needs "
            f"{len(self.pg.bundle_specs)} x {self.bundle} ({placement}), {_amounts(need)} in all; "
            f"the cluster has {_amounts(have)} in all, some of it held by other groups"
        )


def _amounts(resources: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(resources.items()))


class RayExecutor:
    """The launcher's Ray side: one RayWorkerGroup per replica, and the events they post."""

    def __init__(self, args: ServerArgs, args_file: str) -> None:
        self.args = args
        with open(args_file, "rb") as f:
            self.args_bytes = f.read()
        self.groups: dict[int, RayWorkerGroup] = {}
        self.events: queue.SimpleQueue[GroupEvent] = queue.SimpleQueue()
        self.wakeup, self._wakeup_writer = socket.socketpair()
        """Readable when events are queued: the supervisor polls it beside its sockets."""
        self._wakeup_writer.setblocking(False)

    def post(self, event: GroupEvent) -> None:
        self.events.put(event)
        try:
            self._wakeup_writer.send(b"\0")
        except BlockingIOError:
            pass  # the pair is full of wake-ups already

    def drain(self) -> list[GroupEvent]:
        """Every event queued (called when `wakeup` is readable, or at any time)."""
        try:
            self.wakeup.recv(4096, socket.MSG_DONTWAIT)
        except BlockingIOError:
            pass
        out = []
        while not self.events.empty():
            out.append(self.events.get())
        return out

    def start_group(self, dp_rank: int, generation: int) -> None:
        self.stop_group(dp_rank)
        self.groups[dp_rank] = RayWorkerGroup(self, dp_rank, generation)

    def stop_group(self, dp_rank: int) -> None:
        group = self.groups.pop(dp_rank, None)
        if group is not None:
            group.stop()

    def close(self) -> None:
        """Stops every group and leaves the cluster (a Ray started for this server stops with it)."""
        for d in list(self.groups):
            self.stop_group(d)
        self.wakeup.close()
        self._wakeup_writer.close()
        ray.shutdown()
