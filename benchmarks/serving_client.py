"""One streamed `/v1/completions` request and a run of them (Poisson arrivals, a concurrency
limit), timed chunk by chunk; plus the small calls around a run (model name, warm-up, cache flush)."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
from serving_workload import BenchRequest
from tqdm import tqdm


@dataclass
class RequestOptions:
    model: str
    api_key: str | None = None
    ignore_eos: bool = True
    min_tokens: bool = True
    temperature: float = 0.0


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_len: int
    """Requested output tokens."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    start: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunks: int = 0
    finished: bool = False
    """A choice carried a finish_reason."""
    error: str = ""


def request_payload(req: BenchRequest, opts: RequestOptions, max_tokens: int | None = None) -> dict[str, Any]:
    n = max_tokens or req.output_len
    body: dict[str, Any] = {
        "model": opts.model,
        "prompt": req.prompt,
        "max_tokens": n,
        "temperature": opts.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if opts.min_tokens:
        body["min_tokens"] = n
    return body


def parse_sse_lines(line: str) -> dict[str, Any] | None:
    """The JSON object of one `data:` line; None for other lines and for [DONE]."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    return json.loads(data)


async def send_request(
    session: aiohttp.ClientSession, url: str, req: BenchRequest, opts: RequestOptions, max_tokens: int | None = None
) -> RequestResult:
    """Stream one completion; record chunk arrival times and the server's usage."""
    res = RequestResult(ok=False, prompt_len=req.prompt_len, output_len=max_tokens or req.output_len)
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    res.start = last = time.perf_counter()
    try:
        async with session.post(url, json=request_payload(req, opts, max_tokens), headers=headers) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.read()).decode(errors='replace')[:300]}"
                return res
            async for raw_line in resp.content:  # one line at a time
                obj = parse_sse_lines(raw_line.decode())
                if obj is None:
                    continue
                if "error" in obj:
                    res.error = str(obj["error"])[:300]
                    return res
                if obj.get("usage"):
                    res.prompt_tokens = int(obj["usage"].get("prompt_tokens", 0))
                    res.completion_tokens = int(obj["usage"].get("completion_tokens", 0))
                choices = obj.get("choices") or []
                if choices and choices[0].get("finish_reason"):
                    res.finished = True
                if choices and choices[0].get("text"):
                    now = time.perf_counter()
                    if res.chunks == 0:
                        res.ttft = now - res.start
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.chunks += 1
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - res.start
    if res.completion_tokens == 0:  # a server without include_usage: fall back to chunks
        res.completion_tokens = res.chunks
    res.prompt_tokens = res.prompt_tokens or req.prompt_len
    res.ok = res.chunks > 0 and res.finished
    if not res.ok:
        res.error = f"stream ended after {res.chunks} text chunks without a finish_reason (server failure?)"
    return res


def poisson_delays(rate: float, n: int, seed: int) -> list[float]:
    """Gaps between request sends: exponential with mean 1/rate; all zero for rate = inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed ^ 0x5EED)
    return [rng.expovariate(rate) for _ in range(n)]


async def run_requests(
    base_url: str,
    requests: Sequence[BenchRequest],
    opts: RequestOptions,
    rate: float,
    max_concurrency: int | None,
    seed: int,
    progress: bool = True,
    max_tokens: int | None = None,
    timeout_s: float = 3600.0,
) -> tuple[list[RequestResult], float]:
    """Send every request (Poisson arrivals at `rate`, at most `max_concurrency` in flight); (results, wall s)."""
    url = base_url.rstrip("/") + "/v1/completions"
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), disable=not progress, desc="requests", unit="req", leave=False)

    async def one(session: aiohttp.ClientSession, req: BenchRequest) -> RequestResult:
        if sem is None:
            res = await send_request(session, url, req, opts, max_tokens)
        else:
            async with sem:
                res = await send_request(session, url, req, opts, max_tokens)
        bar.update(1)
        return res

    # aiohttp, not httpx: with many streams in flight it uses a fraction of httpx's CPU, CPU
    # that a server under test on the same cores would otherwise lack.
    connector = aiohttp.TCPConnector(limit=max_concurrency or len(requests) or 1)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        tasks = []
        for req, delay in zip(requests, poisson_delays(rate, len(requests), seed), strict=True):
            if delay:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(session, req)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
    bar.close()
    for r in results:
        r.start -= t0  # seconds since the run began
    return results, duration


def fetch_model_name(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


async def warm_up(base_url: str, requests: Sequence[BenchRequest], opts: RequestOptions, n: int) -> None:
    if n <= 0:
        return
    warm = [requests[i % len(requests)] for i in range(n)]
    results, _ = await run_requests(base_url, warm, opts, math.inf, None, 0, progress=False, max_tokens=8)
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"warm-up failed: {bad[0]}")


async def flush_cache(base_url: str, api_key: str | None) -> str | None:
    """Empty the server's prefix cache so each run starts cold: trident/SGLang `/flush_cache`,
    vLLM `/reset_prefix_cache`; the path that answered 2xx, or None."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=30) as client:
        for path in ("/flush_cache", "/reset_prefix_cache"):
            try:
                resp = await client.post(base_url.rstrip("/") + path, headers=headers)
            except httpx.HTTPError:
                continue
            if resp.is_success:
                return path
    return None
