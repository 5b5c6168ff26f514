"""The restart policy tells a crash loop from a fault: a process that served is restarted
at once and costs no budget, one that cannot come up backs off and, past the budget, the
launcher fails open requests and exits non-zero (or stays up answering 503 if asked)."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil

from tests.helpers import Server, wait_until, write_sim_profile
from tests.test_simulated_worker import sim_args
from tests.workload import child
from trident.restart_policy import BACKOFF_CAP_S, BACKOFF_FIRST_S, SETTLE_S, RestartPolicy
from trident.supervisor import EXIT_GAVE_UP


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_deaths_after_a_settled_start_never_count_against_the_budget():
    clock = Clock()
    policy = RestartPolicy(max_restarts=2, window_s=300, clock=clock)
    unit = ("worker", 0)
    for _ in range(50):  # 50 faults in 50 * (SETTLE_S + 1) s: far past 2 per 300 s
        policy.started(unit)
        clock.now += 3
        policy.ready(unit)
        clock.now += SETTLE_S + 1
        decision = policy.on_death(unit)
        assert decision.restart and not decision.counted and decision.delay_s == 0
    assert policy.restarts == 50


def test_quick_failures_back_off_exponentially_capped_and_give_up_past_the_budget():
    clock = Clock()
    policy = RestartPolicy(max_restarts=8, window_s=10_000, clock=clock)
    unit = ("scheduler", 0)
    delays = []
    for _ in range(8):
        policy.started(unit)
        clock.now += 1  # dies before it is ready
        decision = policy.on_death(unit)
        assert decision.restart and decision.counted and "before it was ready" in decision.why
        delays.append(decision.delay_s)
        clock.now += decision.delay_s
    assert delays == [min(BACKOFF_CAP_S, BACKOFF_FIRST_S * 2**i) for i in range(8)]
    policy.started(unit)
    policy.ready(unit)
    clock.now += SETTLE_S / 2  # ready, but dies soon after: still a quick failure
    decision = policy.on_death(unit)
    assert not decision.restart and decision.counted and "after ready" in decision.why


def test_a_stable_period_resets_the_backoff_and_old_failures_leave_the_window():
    clock = Clock()
    policy = RestartPolicy(max_restarts=3, window_s=60, clock=clock)
    unit = ("tokenizer", 0)
    for _ in range(3):
        policy.started(unit)
        clock.now += 1
        assert policy.on_death(unit).counted
    policy.started(unit)
    policy.ready(unit)
    clock.now += 120  # served two minutes: the backoff starts over, the window has moved on
    assert policy.on_death(unit).delay_s == 0
    policy.started(unit)
    clock.now += 1
    decision = policy.on_death(unit)
    assert decision.restart and decision.delay_s == BACKOFF_FIRST_S


def test_a_worker_that_cannot_start_again_makes_the_launcher_fail_open_requests_and_exit_3(tmp_path):
    # The simulated worker reads its profile only at start: without it, every restart fails
    # before it is ready, a crash loop. A budget of 3 must run out, and the launcher exit,
    # within the backoffs (0.5 + 1 + 2 s) plus four worker starts (slow on a loaded machine;
    # the default budget of 5 adds 12 s of backoff and two more starts).
    profile = write_sim_profile(str(tmp_path / "profile.json"), const_s=0.002)
    server = Server(sim_args(profile, "--max-restarts", "3"))
    try:
        tree = server.process_tree()
        http = server.http()
        os.remove(profile)
        child(server, "trident::worker[tp0]").send_signal(signal.SIGKILL)
        started = time.monotonic()
        with ThreadPoolExecutor(1) as pool:
            body = {"text": "hello", "sampling_params": {"max_new_tokens": 4}}
            open_request = pool.submit(http.post, "/generate", json=body, timeout=150)
            assert server.proc.wait(timeout=150) == EXIT_GAVE_UP
            took = time.monotonic() - started
            r = open_request.result()
        assert r.status_code == 503 and "gave up restarting after worker[tp0]" in r.json()["error"]["message"]
        assert took < 120, took
        log = server.log_tail(400)
        assert "restarting after: worker[tp0]" in log and "quick failure 3 of 3" in log
        assert "giving up restarting" in log and "exiting" in log
        assert wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in tree), 5)
    finally:
        server.stop()


def test_on_give_up_stay_keeps_answering_503_with_the_reason(tmp_path):
    profile = write_sim_profile(str(tmp_path / "profile.json"), const_s=0.002)
    server = Server(sim_args(profile, "--on-give-up", "stay", "--max-restarts", "1"))
    try:
        os.remove(profile)
        child(server, "trident::worker[tp0]").send_signal(signal.SIGKILL)
        assert wait_until(lambda: httpx.get(server.base_url + "/health").status_code == 503, 60)
        assert "gave up restarting" in httpx.get(server.base_url + "/health").json()["reason"]
        r = server.http().post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 503 and "gave up restarting" in r.json()["error"]["message"]
        assert server.proc.poll() is None
    finally:
        server.stop()
