"""1,000 concurrent streaming clients are held; a burst past the queue limit gets 503s.

What holds the streams is the tokenizer and the scheduler, so the worker is simulated: a
step takes STEP_S whatever it holds, and the streams stay open as long as 256 tokens each
took on a tiny real model, with an eighth of the events to stream and parse."""

from __future__ import annotations

import asyncio

import httpx

from tests.helpers import running_server, wait_until, write_sim_profile

STREAMS = 1000
MAX_NEW = 32
STEP_S = 0.1


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


async def hold_streams_then_burst(base_url: str) -> tuple[list[tuple[int, int]], list[int], list[str]]:
    limits = httpx.Limits(max_connections=STREAMS + 200, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
        held = [asyncio.create_task(stream_one(client, i)) for i in range(STREAMS)]
        # Burst once the tokenizer holds (nearly) all of them open (a live count, unlike the
        # scheduler's periodic stats). The streams are long enough (MAX_NEW steps of STEP_S,
        # 64 at a time) to still be open when the busy tokenizer gets to the burst, which then
        # crosses the queue limit.
        for _ in range(1200):
            await asyncio.sleep(0.05)
            if (await client.get("/server_info")).json()["tokenizer_stats"]["open_requests"] >= STREAMS - 50:
                break
        # Larger than the streams that may finish meanwhile, so the queue limit is crossed.
        burst = [
            client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4}}) for _ in range(300)
        ]
        burst_responses = await asyncio.gather(*burst)
        return (
            await asyncio.gather(*held),
            [r.status_code for r in burst_responses],
            [r.headers.get("retry-after", "") for r in burst_responses if r.status_code == 503],
        )


def test_a_thousand_streams_complete_and_a_burst_past_the_queue_gets_503(tmp_path):
    profile = write_sim_profile(str(tmp_path / "profile.json"), const_s=STEP_S)
    flags = [
        "--worker",
        "simulated",
        "--sim-profile",
        profile,
        "--max-running-requests",
        "64",
        "--max-queued-requests",
        str(STREAMS - 64),
    ]
    with running_server(flags) as server:
        rss_before = sum(p.memory_info().rss for p in server.process_tree())
        held, burst_codes, retry_after = asyncio.run(hold_streams_then_burst(server.base_url))
        rss_after = sum(p.memory_info().rss for p in server.process_tree())
        assert [code for code, _ in held] == [200] * STREAMS
        assert all(events >= 1 for _, events in held)
        assert 503 in burst_codes and set(burst_codes) <= {200, 503}
        assert all(retry_after)
        assert rss_after - rss_before < 512 * 2**20  # bounded: no per-stream leak of note
        assert server.http().get("/health").status_code == 200
        assert all(p.is_running() for p in server.process_tree())
        http = server.http()
        assert wait_until(lambda: http.get("/server_info").json()["scheduler_stats"]["running_requests"] == 0, 10)
