"""The loss of a whole node is reported, not waited out: node 0 answers 503 naming the
missing node, requests fail fast, and the node's launcher, started again with its original
command, rejoins without anyone touching node 0."""

from __future__ import annotations

import os
import signal
import time

import httpx

from tests.helpers import Server, free_port, free_port_block, running_server, wait_until, write_sim_profile
from tests.test_simulated_worker import completions, sim_args
from trident.node_watch import NodeWatch
from trident.wire.signing import new_secret, write_secret_file


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_silent_node_goes_missing_once_and_its_next_hello_is_a_rejoin():
    clock = Clock()
    watch = NodeWatch(3, clock)
    assert not watch.hello(1, pid=100) and not watch.hello(2, pid=200)
    clock.now = 3.0
    watch.hello(2, pid=200)  # a heartbeat
    assert watch.newly_missing() == []
    clock.now = 4.5
    assert watch.newly_missing() == [1] and watch.newly_missing() == []
    assert "node 1 is missing" in watch.describe_missing()
    assert watch.hello(1, pid=101) and not watch.missing  # its launcher restarted
    assert watch.hello(2, pid=201)  # a new launcher, even without a silence noticed


def test_killing_node_1s_process_group_answers_503_naming_it_until_it_rejoins(tmp_path):
    profile = write_sim_profile(str(tmp_path / "profile.json"), const_s=0.002)
    secret = str(tmp_path / "cluster.secret")
    write_secret_file(secret, new_secret())
    cluster = [
        *sim_args(profile, "--tp-size", "2", "--nnodes", "2"),
        *("--dist-init-addr", f"127.0.0.1:{free_port_block()}", "--cluster-secret-file", secret),
    ]
    node1_command = [*cluster, "--node-rank", "1", "--port", str(free_port())]
    node1 = Server(node1_command, ready_prefix="trident node 1 ready:", own_process_group=True)
    try:
        with running_server([*cluster, "--node-rank", "0"]) as node0:
            before_loss = completions(node0, stream=False)
            os.killpg(node1.proc.pid, signal.SIGKILL)
            node1.proc.wait()

            def health() -> httpx.Response:
                return httpx.get(node0.base_url + "/health", timeout=5)

            assert wait_until(lambda: health().status_code == 503, 10), node0.log_tail()
            assert "node 1 is missing" in health().json()["reason"]
            started = time.monotonic()
            r = node0.http().post("/v1/completions", json={"model": "smollm2-135m", "prompt": "hi", "max_tokens": 4})
            assert r.status_code == 503 and "node 1 is missing" in r.json()["error"]["message"]
            assert time.monotonic() - started < 10

            node1 = Server(node1_command, ready_prefix="trident node 1 ready:", own_process_group=True)
            assert wait_until(lambda: health().status_code == 200, 60), node0.log_tail()
            assert completions(node0, stream=False) == before_loss
            assert "node 1 rejoined" in node0.log_tail(400)
    finally:
        node1.stop()
