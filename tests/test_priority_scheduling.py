"""`--schedule-policy priority` with vLLM's `priority` request field, on the real tokenizer and
scheduler over a simulated worker (steps of a fixed time, no model): one request runs at a
time, so the order in which queued requests finish is the order they were admitted in."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import Server, running_server, wait_until, write_sim_profile

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def priority_server(tmp_path_factory) -> Iterator[Server]:
    profile = write_sim_profile(str(tmp_path_factory.mktemp("sim") / "profile.json"), const_s=0.01)
    args = ["--worker", "simulated", "--sim-profile", profile, "--check-seq-lens"]
    with running_server([*args, "--schedule-policy", "priority", "--max-running-requests", "1"]) as server:
        yield server


def test_queued_requests_are_admitted_lowest_priority_first_whatever_their_arrival(priority_server):
    client = priority_server.client(timeout=120)
    finished: list[str] = []
    lock = threading.Lock()

    def run(name: str, priority: int, max_tokens: int) -> None:
        extra = {"ignore_eos": True, "priority": priority, "request_id": name}
        client.completions.create(model=MODEL, prompt=f"{name}:", max_tokens=max_tokens, extra_body=extra)
        with lock:
            finished.append(name)

    def stats() -> dict:
        return priority_server.scheduler_stats()

    with ThreadPoolExecutor(5) as pool:
        blocker = pool.submit(run, "blocker", 0, 4000)
        assert wait_until(lambda: stats()["running_requests"] == 1, 30)
        queued = []
        for name, priority in [("late", 5), ("urgent", -1), ("middle", 3), ("late-too", 5)]:
            queued.append(pool.submit(run, name, priority, 4))
            assert wait_until(lambda n=len(queued): stats()["queued_requests"] == n, 30)
        assert priority_server.http().post("/abort", json={"rid": "cmpl-blocker"}).json()["aborted"]
        for future in [blocker, *queued]:
            future.result()
    assert finished == ["blocker", "urgent", "middle", "late", "late-too"]
