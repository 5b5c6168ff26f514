"""Data parallelism behind one tokenizer, and one server spread over two launch.py "nodes".

dp 2 serves the fault suite's workload with the same greedy outputs as dp 1, through both
replicas (per-replica counters in /server_info and /metrics); killing one replica's worker
restarts that replica only. The router's three methods do what --load-balance-method says.
Two launch.py processes (--nnodes 2, node ranks 0 and 1, tp 2 split across them) serve
together with tp 1's outputs; a rank on node 1 killed mid-generation is restarted with its
group; the cross-node ports listen only on the given address; frames signed with the wrong
key are rejected and counted; stopping node 0 stops node 1.
"""

from __future__ import annotations

import signal
import socket

import httpx
import pytest
import zmq

from tests.helpers import Server, free_port_block, running_server, wait_until
from tests.workload import BASE, child, run_with_fault
from tokenizer_proc.router import IMBALANCE_LIMIT, PREFIX_BLOCK, ReplicaRouter
from trident.launch import main as launch_main
from trident.wire.backend import ResetBatch
from trident.wire.cluster import ClusterError, ClusterLayout
from trident.wire.codec import FrameEncoder
from trident.wire.signing import FrameSigner, new_secret, write_secret_file


def replica_counts(server: Server) -> list[dict]:
    return server.http().get("/server_info").json()["replicas"]


# ---------------------------------------------------------------------------- router


def test_round_robin_takes_replicas_in_turn():
    router = ReplicaRouter(3, "round_robin")
    picks = []
    for _ in range(6):
        d = router.choose([1, 2, 3])
        router.opened(d, [1, 2, 3])
        picks.append(d)
    assert picks == [0, 1, 2, 0, 1, 2]


def test_shortest_queue_picks_the_replica_with_fewest_open_requests():
    router = ReplicaRouter(3, "shortest_queue")
    for d, n in [(0, 5), (1, 2), (2, 7)]:
        router.opened(d, [], n)
    assert router.choose([1]) == 1
    for _ in range(4):
        router.closed(0)
    assert router.choose([1]) == 0


def test_longest_prefix_follows_the_cached_prefix_and_falls_back_to_shortest_queue():
    router = ReplicaRouter(2, "longest_prefix")
    system_a = list(range(100, 100 + 3 * PREFIX_BLOCK))
    system_b = list(range(900, 900 + 3 * PREFIX_BLOCK))
    first_a = router.choose(system_a + [1])
    router.opened(first_a, system_a + [1])
    first_b = router.choose(system_b + [2])  # no match: the emptier replica
    router.opened(first_b, system_b + [2])
    assert first_a != first_b
    for i in range(5):  # the same system prompt sticks to its replica while the load is close
        assert router.choose(system_a + [i + 10]) == first_a
        router.opened(first_a, system_a + [i + 10])
    router.opened(first_a, [], IMBALANCE_LIMIT)  # far busier now: balance wins over the cache
    assert router.choose(system_a + [99]) == first_b
    assert router.choose(system_a[: PREFIX_BLOCK - 1]) in (0, 1)  # under one block: no match


def test_cluster_layout_splits_ranks_over_nodes_and_rejects_impossible_layouts():
    layout = ClusterLayout(dp_size=2, tp_size=4, nnodes=2, node_rank=1, host="10.0.0.1", base_port=5000)
    assert list(layout.local_ranks()) == [2, 3] and list(layout.local_ranks(0)) == [0, 1]
    assert layout.is_remote_rank(2) and not layout.is_remote_rank(1)
    assert layout.store_port(1) == 5002 and layout.descriptor_address(1) == "tcp://10.0.0.1:5003"
    assert layout.control_address() == "tcp://10.0.0.1:5004"
    for bad in [dict(tp_size=3, nnodes=2), dict(node_rank=2, nnodes=2), dict(nnodes=2, base_port=0)]:
        kw = dict(dp_size=1, tp_size=2, nnodes=2, node_rank=0, host="h", base_port=5000) | bad
        with pytest.raises(ClusterError):
            ClusterLayout(**kw)


def test_an_impossible_layout_is_a_one_line_startup_error(fault_model, capsys):
    code = launch_main(["--model", fault_model, "--tp-size", "3", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:1"])
    assert code == 2
    assert "does not split over --nnodes 2" in capsys.readouterr().err
    code = launch_main(["--model", fault_model, "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "127.0.0.1:1"])
    assert code == 2
    assert "need --cluster-secret-file" in capsys.readouterr().err


def test_a_frame_signed_with_another_key_is_rejected():
    signer, stranger = FrameSigner(new_secret()), FrameSigner(new_secret())
    payload = b"\x93\xa5hello\x01\x02"
    assert signer.verify(signer.sign(payload), "test") == payload
    assert signer.verify(stranger.sign(payload), "test") is None
    assert signer.verify(b"short", "test") is None
    assert signer.rejected == 2


# ---------------------------------------------------------------------------- data parallel


@pytest.fixture(scope="module")
def dp2_server(fault_model):
    """Shared by the dp 2 tests; the one that kills a replica's worker runs last."""
    with running_server(["--model", fault_model, *BASE, "--dp-size", "2"]) as server:
        yield server


def test_dp2_serves_through_both_replicas_with_dp1_outputs(dp2_server, fault_reference):
    server = dp2_server
    assert run_with_fault(server, None) == fault_reference
    replicas = replica_counts(server)
    assert [r["routed_requests"] for r in replicas] == [6, 6]  # round robin over 12 requests
    assert wait_until(
        lambda: all(
            r["scheduler_stats"] and r["scheduler_stats"]["generation_tokens"] > 0 for r in replica_counts(server)
        ),
        10,
    )
    metrics = server.http().get("/metrics").text
    assert 'trident_replica_requests_routed_total{dp_rank="1"} 6.0' in metrics


def test_dp2_longest_prefix_keeps_each_system_prompt_on_one_replica(fault_model):
    flags = ["--dp-size", "2", "--load-balance-method", "longest_prefix"]
    with running_server(["--model", fault_model, *BASE, *flags]) as s:
        http = s.http()
        systems = [list(range(200, 264)), list(range(5000, 5064))]
        for i in range(8):
            body = {"input_ids": systems[i % 2] + [30 + i], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
            r = http.post("/generate", json=body)
            assert r.status_code == 200, r.text
            if i >= 2:  # the replica that already holds this system prompt serves it from cache
                assert r.json()["meta_info"]["cached_tokens"] >= 64
        assert [r["routed_requests"] for r in replica_counts(s)] == [4, 4]


def test_killing_one_replicas_worker_restarts_that_replica_only(dp2_server, fault_reference):
    server = dp2_server
    other = child(server, "trident::worker[dp0.tp0]").pid

    def kill_replica1(srv: Server) -> None:
        child(srv, "trident::worker[dp1.tp0]").send_signal(signal.SIGKILL)

    assert run_with_fault(server, kill_replica1) == fault_reference
    assert child(server, "trident::worker[dp0.tp0]").pid == other


# ---------------------------------------------------------------------------- two nodes


@pytest.fixture
def secret_file(tmp_path) -> str:
    path = str(tmp_path / "cluster.secret")
    write_secret_file(path, new_secret())
    return path


def send_signed_with(address: str, signer: FrameSigner, frames: list[bytes]) -> None:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(address)
        for frame in frames:
            sock.send(signer.sign(frame))
        sock.close()
    finally:
        ctx.term()


def test_two_nodes_serve_tp2_together_and_reject_bad_tags(fault_model, fault_reference, secret_file):
    port = free_port_block()
    cluster = [
        "--model",
        fault_model,
        *BASE,
        "--tp-size",
        "2",
        "--nnodes",
        "2",
        "--dist-init-addr",
        f"127.0.0.1:{port}",
        "--cluster-secret-file",
        secret_file,
    ]
    node1 = Server([*cluster, "--node-rank", "1"], ready_prefix="trident node 1 ready:")
    try:
        with running_server([*cluster, "--node-rank", "0"]) as node0:
            health = httpx.get(node1.base_url + "/health").json()
            assert health["status"] == "ok" and health["workers_alive"] == 1
            assert {" ".join(p.cmdline()).strip() for p in node1.process_tree()[1:]} == {"trident::worker[tp1]"}
            assert "trident::worker[tp1]" not in {" ".join(p.cmdline()).strip() for p in node0.process_tree()}
            control = port + 2  # the cross-node ports listen only on --dist-init-addr's address
            assert _listening("127.0.0.1", control)
            own_ip = _non_loopback_ip()
            if own_ip is not None:
                assert not _listening(own_ip, control)

            def kill_rank1(_srv: Server) -> None:
                child(node1, "trident::worker[tp1]").send_signal(signal.SIGKILL)

            assert run_with_fault(node0, kill_rank1) == fault_reference  # tp 2 over two nodes == tp 1
            assert wait_until(lambda: httpx.get(node1.base_url + "/health").status_code == 200, 30)

            descriptor_port = f"tcp://127.0.0.1:{port + 1}"
            forged = FrameEncoder().encode(ResetBatch(next_step_id=1))
            send_signed_with(descriptor_port, FrameSigner(new_secret()), [forged, b"junk"])
            assert wait_until(
                lambda: node0.http().get("/server_info").json()["scheduler_stats"]["rejected_frames"] >= 2, 15
            )
            assert 'trident_replica_rejected_frames_total{dp_rank="0"} 2.0' in node0.http().get("/metrics").text
            assert run_with_fault(node0, None) == fault_reference  # nothing was acted on
        node1.proc.wait(timeout=15)  # node 0's stop stops node 1
        assert node1.proc.returncode == 0
    finally:
        node1.stop()


def _listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _non_loopback_ip() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip
