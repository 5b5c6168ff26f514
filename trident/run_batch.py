"""`trident run-batch -i IN.jsonl -o OUT.jsonl [server flags]`: OpenAI's batch file format,
served offline, as `vllm run-batch` does.

Each input line is `{"custom_id", "method": "POST", "url", "body"}`. The command starts a
server with the given flags on a free local port, sends every line's body to its route
(`--max-concurrency` at once, so the scheduler batches them), and writes one output line per
input line, in input order:
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`. A route's
own refusal (a 400, say) is a response with that status and its error body, as OpenAI's batch
output has it; a line that cannot be sent at all (not JSON, another route, streamed) has
`response: null` and `error` saying why. The server is the real one, so every answer is
exactly what the HTTP API gives.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

import httpx

from trident.child_process import free_port
from trident.cli import model_first
from trident.flags import build_parser

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages")
"""The routes a batch line may name."""

READY_POLL_S = 0.2


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This command's own flags, and the rest: the server's flags (`trident serve --help`)."""
    parser = argparse.ArgumentParser(prog="trident run-batch", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("-i", "--input-file", required=True, help="the batch: a JSONL file, or - for stdin")
    parser.add_argument("-o", "--output-file", required=True, help="where the results go: a JSONL file, or -")
    parser.add_argument("--max-concurrency", type=int, default=64, help="requests in flight at once")
    parser.add_argument("--startup-timeout-s", type=float, default=600.0, help="how long the server may take to start")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    ns, server_flags = parse_args(sys.argv[1:] if argv is None else argv)
    server_flags = model_first(server_flags)
    api_key = build_parser().parse_args(server_flags).api_key  # and a bad flag stops us here
    with sys.stdin if ns.input_file == "-" else open(ns.input_file, encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    port = free_port()
    # The server's log goes to stderr: stdout may be the results (`-o -`).
    command = [sys.executable, "-m", "trident", "serve", *server_flags, "--port", str(port)]
    server = subprocess.Popen(command, stdout=sys.stderr)
    try:
        base_url = f"http://127.0.0.1:{port}"
        if not wait_ready(server, base_url, ns.startup_timeout_s):
            print("error: the server did not start (its log is above)", file=sys.stderr)
            return 1
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        results = asyncio.run(run_lines(base_url, headers, lines, ns.max_concurrency))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait()
    out_text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results)
    if ns.output_file == "-":
        sys.stdout.write(out_text)
    else:
        with open(ns.output_file, "w", encoding="utf-8") as f:
            f.write(out_text)
    failed = sum(r["error"] is not None or r["response"]["status_code"] != 200 for r in results)
    print(f"run-batch: {len(results)} requests, {failed} failed", file=sys.stderr)
    return 0


def wait_ready(server: subprocess.Popen, base_url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(READY_POLL_S)
    return False


async def run_lines(base_url: str, headers: dict[str, str], lines: list[str], concurrency: int) -> list[dict[str, Any]]:
    """Every line's output, in input order, with progress on stderr."""
    gate = asyncio.Semaphore(concurrency)
    done = 0

    async def one(client: httpx.AsyncClient, line: str) -> dict[str, Any]:
        nonlocal done
        async with gate:
            result = await run_line(client, line)
        done += 1
        print(f"\rrun-batch: {done}/{len(lines)}", end="" if done < len(lines) else "\n", file=sys.stderr)
        return result

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=None, limits=limits) as client:
        return list(await asyncio.gather(*(one(client, line) for line in lines)))


async def run_line(client: httpx.AsyncClient, line: str) -> dict[str, Any]:
    request, why = read_line(line)
    custom_id = request.get("custom_id") if request is not None else None
    out: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None}
    if why:
        return {**out, "error": {"code": "invalid_request", "message": why}}
    assert request is not None
    request_id = f"{custom_id or 'line'}-{uuid.uuid4().hex[:8]}"
    answer = await client.post(request["url"], json=request["body"], headers={"X-Request-Id": request_id})
    body = answer.json() if answer.headers.get("content-type", "").startswith("application/json") else answer.text
    response = {"status_code": answer.status_code, "request_id": request_id, "body": body}
    return {**out, "response": response, "error": None}


def read_line(line: str) -> tuple[dict[str, Any] | None, str]:
    """(the request, "") or (the request as far as it reads, why it cannot be sent)."""
    try:
        request = json.loads(line)
    except ValueError as e:
        return None, f"the line is not JSON: {e}"
    if not isinstance(request, dict):
        return None, "a line is a JSON object"
    if not isinstance(request.get("body"), dict):
        return request, 'a line has a "body" object'
    if request.get("method", "POST") != "POST" or request.get("url") not in ROUTES:
        return request, f"url must be one of {', '.join(ROUTES)} (method POST), not {request.get('url')!r}"
    if request["body"].get("stream"):
        return request, "a batch request is not streamed: drop `stream`"
    return request, ""


if __name__ == "__main__":
    sys.exit(main())
