"""1,000 concurrent streaming clients are held; a burst past the queue limit gets 503s.

What holds the streams is the tokenizer and the scheduler, so the worker is simulated: a
step takes STEP_S whatever it holds.

The burst must find the server full whatever the host's speed: the scheduler process is
stopped (SIGSTOP) while the streams open, so none of them can finish and the tokenizer's
open count reaches its capacity (max running + max queued = STREAMS) exactly. Every request
of the burst is then past the queue limit. The scheduler resumes (SIGCONT) and every held
stream, all of them opened before and waiting through the burst, streams to its end."""

from __future__ import annotations

import asyncio

import httpx
import psutil

from tests.helpers import running_server, wait_until, write_sim_profile
from tests.workload import child

STREAMS = 1000
MAX_RUNNING = 64
MAX_NEW = 16
STEP_S = 0.05
BURST = 100


async def stream_one(client: httpx.AsyncClient, i: int) -> tuple[int, int]:
    body = {
        "input_ids": [100 + i % 500, 7, 8, 9],
        "stream": True,
        "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True},
    }
    events = 0
    async with client.stream("POST", "/generate", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, 0
        async for line in r.aiter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                events += 1
    return 200, events


async def open_count(client: httpx.AsyncClient) -> int:
    """The tokenizer's live count of open requests."""
    return (await client.get("/server_info")).json()["tokenizer_stats"]["open_requests"]


def burst_request(client: httpx.AsyncClient, i: int):
    """Half native, half OpenAI: both front doors apply the same limit."""
    if i % 2:
        return client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
    return client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4}})


async def hold_streams_then_burst(
    base_url: str, scheduler: psutil.Process
) -> tuple[list[tuple[int, int]], int, list[httpx.Response]]:
    limits = httpx.Limits(max_connections=STREAMS + BURST + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
        scheduler.suspend()
        try:
            held = [asyncio.create_task(stream_one(client, i)) for i in range(STREAMS)]
            for _ in range(2400):  # the tokenizer's pace decides; the streams cannot end meanwhile
                if (opened := await open_count(client)) >= STREAMS:
                    break
                await asyncio.sleep(0.05)
            burst_responses = await asyncio.gather(*(burst_request(client, i) for i in range(BURST)))
        finally:
            scheduler.resume()
        return await asyncio.gather(*held), opened, burst_responses


def test_a_thousand_streams_complete_and_a_burst_past_the_queue_gets_503(tmp_path):
    profile = write_sim_profile(str(tmp_path / "profile.json"), const_s=STEP_S)
    flags = ["--worker", "simulated", "--sim-profile", profile]
    flags += ["--max-running-requests", str(MAX_RUNNING), "--max-queued-requests", str(STREAMS - MAX_RUNNING)]
    with running_server(flags) as server:
        scheduler = child(server, "trident::scheduler")
        rss_before = sum(p.memory_info().rss for p in server.process_tree())
        held, opened, burst = asyncio.run(hold_streams_then_burst(server.base_url, scheduler))
        rss_after = sum(p.memory_info().rss for p in server.process_tree())
        assert opened == STREAMS
        assert [r.status_code for r in burst] == [503] * BURST
        for r in burst:
            assert r.headers["retry-after"]
            error = r.json()["error"]
            assert error["type"] == "server_error" and error["code"] == "overloaded"
            assert f"({STREAMS} requests open)" in error["message"]
        assert [code for code, _ in held] == [200] * STREAMS
        assert all(events >= 1 for _, events in held)
        assert rss_after - rss_before < 512 * 2**20  # bounded: no per-stream leak of note
        assert server.http().get("/health").status_code == 200
        assert all(p.is_running() for p in server.process_tree())
        http = server.http()
        assert wait_until(lambda: http.get("/server_info").json()["scheduler_stats"]["running_requests"] == 0, 10)
