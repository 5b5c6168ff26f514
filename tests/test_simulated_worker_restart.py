"""SIGKILL of a simulated worker: the supervisor restarts it, and the requests it held
complete with the output they would have had (simulated tokens resume exactly)."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

from tests.helpers import running_server, wait_until, write_sim_profile
from tests.test_simulated_worker import completions, sim_args, worker_pids


def test_a_killed_simulated_worker_is_restarted_and_requests_complete(tmp_path):
    # 20 ms a step: the workload takes a few seconds, time to kill the worker mid-way.
    profile = write_sim_profile(str(tmp_path / "profile.json"), const_s=0.02)
    with running_server(sim_args(profile)) as server:
        expected = completions(server, stream=False)
        before = server.scheduler_stats()["generation_tokens"]
        [killed] = worker_pids(server)
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(completions, server, False)
            assert wait_until(lambda: server.scheduler_stats()["generation_tokens"] > before + 40, 30, interval=0.05)
            os.kill(killed, signal.SIGKILL)
            assert pending.result(timeout=90) == expected
        assert "restarting after: worker[tp0]" in server.log_tail(400)
        assert worker_pids(server) and worker_pids(server) != [killed]
        assert server.scheduler_stats()["resumed_requests"] > 0
        assert server.http().get("/health").status_code == 200


def test_a_request_whose_last_token_was_in_flight_completes_after_a_worker_kill(tmp_path):
    # With overlap, a one-token request leaves the batch as soon as the step that samples its
    # token is sent: for the whole step only that step in flight owes it anything. 4 s a step
    # puts the kill there; the request must be requeued from the lost step, not forgotten.
    profile = write_sim_profile(str(tmp_path / "profile.json"), const_s=4.0)
    with running_server(sim_args(profile)) as server:
        client = server.client(timeout=60)
        kw = dict(model="smollm2-135m", prompt="The sea", max_tokens=1, temperature=0, extra_body={"ignore_eos": True})
        expected = client.completions.create(**kw).choices[0].text
        [killed] = worker_pids(server)
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(lambda: client.completions.create(**kw).choices[0].text)
            assert wait_until(lambda: server.http().get("/server_info").json()["tokenizer_stats"]["open_requests"], 10)
            time.sleep(1.0)  # the scheduler admits it at once; its step runs 4 s
            os.kill(killed, signal.SIGKILL)
            assert pending.result(timeout=90) == expected
        assert server.scheduler_stats()["resumed_requests"] == 1
