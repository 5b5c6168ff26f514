"""Real processes, real signals: a client sees latency, not an error, and greedy output
does not change when a worker or the scheduler dies or hangs mid-generation.

The faults a server survives at the default flags are applied in turn to one shared server
(`fault_server`), each test counting only its own restarts and frames: later faults then
also prove that a restarted process handles the next one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import msgpack
import pytest
import zmq

from tests.helpers import REPO_ROOT, Server, free_port, running_server, wait_until
from tests.workload import (
    BASE,
    MAX_NEW,
    STATS_PERIOD_S,
    child,
    generation_tokens,
    prompts,
    run_with_fault,
)
from trident.wire.backend import BatchDescriptor, PageAppends, ResetBatch, StepResult, WorkerCounters
from trident.wire.codec import FrameEncoder, pack_int32
from trident.wire.frontend import AbortReq, RowExtras, ServerInfo, TokenOutBatch, WorkerGroupLost
from trident.wire.server_args import ServerArgs
from trident.wire.transport import (
    ENDPOINT_LAUNCHER,
    ENDPOINT_TOKENIZER_IN,
    scheduler_in_endpoint,
    scheduler_reply_endpoint,
    worker_endpoint,
)


def kill_worker(server: Server) -> None:
    child(server, "trident::worker[tp0]").send_signal(signal.SIGKILL)


def kill_scheduler(server: Server) -> None:
    child(server, "trident::scheduler").send_signal(signal.SIGKILL)


def hang_worker(server: Server) -> None:
    child(server, "trident::worker[tp0]").send_signal(signal.SIGSTOP)


def restarts(server: Server) -> float:
    """The launcher's restart count as /metrics reports it."""
    return server.counter("trident_restarts_total")


@pytest.mark.parametrize(
    "fault,flags",
    [
        (kill_worker, []),
        (kill_scheduler, []),
        (hang_worker, ["--watchdog-timeout", "3"]),
        (kill_worker, ["--disable-overlap", "--speculative-algorithm", "ngram"]),
    ],
    ids=["sigkill_worker", "sigkill_scheduler", "sigstop_worker_past_watchdog", "sigkill_worker_plain_loop_spec"],
)
def test_every_request_completes_unchanged_after_a_fault(fault, flags, fault_model, fault_reference, request):
    with ExitStack() as stack:
        if flags:
            server = stack.enter_context(running_server(["--model", fault_model, *BASE, *flags]))
        else:
            server = request.getfixturevalue("fault_server")
        restarts_before = restarts(server)
        before = {p.pid for p in server.process_tree()}
        assert run_with_fault(server, fault) == fault_reference
        after = {p.pid for p in server.process_tree()}
        assert before != after  # the faulty process really was replaced
        assert wait_until(lambda: restarts(server) == restarts_before + 1, 10), restarts(server)


def test_restart_limit_exhaustion_answers_503_with_an_error_body(fault_model):
    with running_server(["--model", fault_model, *BASE, "--max-restarts", "1", "--on-give-up", "stay"]) as server:
        http = server.http()
        # Only a worker killed within 10 s of being ready counts (a quick failure); the first
        # kill may come later than that after start-up. Each next kill follows a request the
        # restarted worker just served, so the second of them at the latest spends the budget.
        for _ in range(3):
            kill_worker(server)
            r = http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=60)
            if r.status_code == 503:
                break
            assert r.status_code == 200, r.text
        assert wait_until(lambda: http.get("/health").status_code == 503, 20)
        assert "gave up restarting after worker[tp0]" in http.get("/health").json()["reason"]
        r = http.post(
            "/v1/completions",
            json={"model": os.path.basename(fault_model), "prompt": "hi", "max_tokens": 4},
            timeout=30,
        )
        assert r.status_code == 503 and "error" in r.json() and r.json()["error"]["message"]


def test_random_bytes_and_wrong_messages_to_every_endpoint_kill_nothing(fault_server):
    server = fault_server
    run_dir = server.http().get("/server_info").json()["run_dir"]
    pids = {p.pid for p in server.process_tree()}
    dropped_before = server.scheduler_stats().get("dropped_frames", 0)
    enc = FrameEncoder()
    wrong = [
        enc.encode(BatchDescriptor(999, 2, [], [], PageAppends(), [], 0)),  # a step out of sequence
        enc.encode(StepResult(12345, pack_int32([1]), WorkerCounters(), 0.0)),  # a result for no step
        enc.encode(TokenOutBatch(["no-such-request"], pack_int32([1, 2]), pack_int32([2]), [RowExtras(0, "stop")])),
        enc.encode(ServerInfo(999, 10, 10, 1, 10, [], "a-scheduler-from-another-version")),
        enc.encode(AbortReq("no-such-request")),
        msgpack.packb(["reset", "x"]),
    ]
    ctx = zmq.Context()
    try:
        endpoints = [
            scheduler_in_endpoint(0),
            ENDPOINT_TOKENIZER_IN,
            scheduler_reply_endpoint(0),
            ENDPOINT_LAUNCHER,
            worker_endpoint(0, 0),
        ]
        for name in endpoints:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(f"ipc://{os.path.join(run_dir, name)}")
            for frame in [os.urandom(n) for n in (1, 17, 300)] + wrong:
                sock.send(frame)
            sock.close()
    finally:
        ctx.term()
    time.sleep(1)
    outputs = run_with_fault(server, None)
    assert all(len(o) == MAX_NEW for o in outputs)
    assert {p.pid for p in server.process_tree()} == pids  # nothing died, nothing restarted
    assert server.scheduler_stats()["dropped_frames"] - dropped_before >= 6


def test_resetbatch_from_a_stranger_costs_one_quick_restart(fault_server, fault_reference):
    """A forged ResetBatch wipes the worker's rows mid-run: the scheduler notices the step
    gap, restarts the workers and still returns the same tokens, in seconds. The lost group
    answers the scheduler's reconnection reset before launch.py kills it; a scheduler that
    took that answer for the new group's sent its steps to nobody, and only its watchdog
    (a second restart, 60 s later) got it going again."""
    run_dir = fault_server.http().get("/server_info").json()["run_dir"]
    watchdog_s = ServerArgs(model_path="").watchdog_timeout_s  # the shared server's

    def forge_reset(_server: Server) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(f"ipc://{os.path.join(run_dir, worker_endpoint(0, 0))}")
        sock.send(FrameEncoder().encode(ResetBatch(next_step_id=1)))
        sock.close()
        ctx.term()

    restarts_before = restarts(fault_server)
    first_line = len(fault_server.output)
    started = time.monotonic()
    assert run_with_fault(fault_server, forge_reset) == fault_reference
    took = time.monotonic() - started
    log = "".join(fault_server.output[first_line:])
    assert "watchdog" not in log, log[-3000:]
    assert took < watchdog_s / 2, f"{took:.0f} s"
    assert wait_until(lambda: restarts(fault_server) == restarts_before + 1, 10), restarts(fault_server)


def test_a_report_about_a_worker_group_already_replaced_is_ignored(fault_server, fault_reference):
    """launch.py reports a group lost while the scheduler, having found the loss itself, is
    connected to the replacement already: the report names an older generation, and acting
    on it would requeue every request and wait for a group that never comes."""
    run_dir = fault_server.http().get("/server_info").json()["run_dir"]

    def stale_report(_server: Server) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(f"ipc://{os.path.join(run_dir, scheduler_in_endpoint(0))}")
        sock.send(FrameEncoder().encode(WorkerGroupLost("a group replaced long ago", generation=0)))
        sock.close()
        ctx.term()

    resumed_before = fault_server.scheduler_stats()["resumed_requests"]
    assert run_with_fault(fault_server, stale_report) == fault_reference
    time.sleep(STATS_PERIOD_S)
    assert fault_server.scheduler_stats()["resumed_requests"] == resumed_before


def test_sigterm_drains_open_requests_before_exit(fault_model):
    # Generous: the drain must outlast the requests even on a loaded 2-core machine.
    server = Server(["--model", fault_model, *BASE, "--shutdown-timeout", "60"])
    try:
        http = server.http()
        with ThreadPoolExecutor(4) as pool:
            futures = [
                pool.submit(
                    http.post,
                    "/generate",
                    json={
                        "input_ids": p,
                        "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True},
                    },
                    timeout=120,
                )
                for p in prompts()[:4]
            ]
            assert wait_until(lambda: generation_tokens(server) > 8, 60)
            server.proc.send_signal(signal.SIGTERM)
            results = [f.result() for f in futures]
        assert [r.status_code for r in results] == [200] * 4
        assert all(r.json()["meta_info"]["finish_reason"] == "length" for r in results)
        assert server.proc.wait(timeout=30) == 0
    finally:
        server.stop()


def test_launch_py_without_a_free_port_is_a_clear_error(fault_model):
    port = free_port()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        res = subprocess.run(
            [sys.executable, "launch.py", "--model", fault_model, "--port", str(port), *BASE],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=240,
        )
    assert res.returncode != 0 and "cannot listen" in res.stderr


def test_a_killed_tokenizer_is_restarted_and_its_requests_are_freed(fault_server):
    server = fault_server
    http = server.http()
    before = generation_tokens(server)
    with ThreadPoolExecutor(2) as pool:
        lost = [
            pool.submit(
                http.post,
                "/generate",
                json={"text": "x", "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}},
                timeout=60,
            )
            for _ in range(2)
        ]
        assert wait_until(lambda: generation_tokens(server) > before + 4, 60)
        old = child(server, "trident::tokenizer")
        old.send_signal(signal.SIGKILL)
        for f in lost:  # their connections die with the process: an error, never a hang
            with pytest.raises(Exception):  # noqa: B017 - any transport error is the expected outcome
                f.result()

    def serving_again() -> bool:
        try:
            return (
                http.post(
                    "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=5
                ).status_code
                == 200
            )
        except Exception:
            return False

    assert wait_until(serving_again, 60)
    assert child(server, "trident::tokenizer").pid != old.pid
    # The scheduler dropped the dead tokenizer's two long requests.
    assert wait_until(lambda: http.get("/server_info").json()["scheduler_stats"]["running_requests"] == 0, 20), (
        http.get("/server_info").json()["scheduler_stats"],
        server.log_tail(40),
    )


def test_requests_sent_while_the_scheduler_is_down_run_once_on_its_successor(fault_server, fault_reference):
    """Requests sent between a scheduler's death and its successor's start wait in the
    tokenizer's socket and reach the successor, which the tokenizer also resubmits its open
    requests to: each must run once (a second copy used to fail it with 'already running')."""
    killed = child(fault_server, "trident::scheduler")
    killed.send_signal(signal.SIGKILL)
    assert run_with_fault(fault_server, None) == fault_reference
    assert child(fault_server, "trident::scheduler").pid != killed.pid
