"""The HTTP front door's connections: small writes go at once, and an idle keep-alive
connection stays open longer than clients keep theirs.

asyncio turns Nagle's algorithm off only on sockets that say they are TCP; a socket made
with proto 0 kept it on, and each response's last small write then waited for the client's
delayed ACK, which made every non-streamed response many times slower (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import select
import socket
import time

from tests.helpers import running_server, write_sim_profile
from tokenizer_proc.__main__ import _bind

HTTPX_KEEPALIVE_EXPIRY_S = 5.0
"""httpx's default idle expiry, which the openai client inherits."""


def test_connections_accepted_on_the_http_socket_have_nagle_off():
    async def accepted_nodelay() -> int:
        listening = _bind("127.0.0.1", 0)
        port = listening.getsockname()[1]
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def on_connect(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=listening)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            value = await asyncio.wait_for(seen, 10)
            writer.close()
        return value

    assert asyncio.run(accepted_nodelay()) != 0


def _get_health(conn: socket.socket, port: int) -> bytes:
    conn.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    return conn.recv(65536)


def test_an_idle_connection_outlives_the_clients_own_keep_alive_expiry(tmp_path):
    """If the server closed idle connections when httpx does (5 s), a request sent on one as
    it closed would fail with 'Server disconnected': the client must be the one to close."""
    profile = write_sim_profile(str(tmp_path / "profile.json"), const_s=0.01)
    with running_server(["--worker", "simulated", "--sim-profile", profile]) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
            assert _get_health(conn, server.port).startswith(b"HTTP/1.1 200")
            time.sleep(HTTPX_KEEPALIVE_EXPIRY_S + 1.5)
            readable, _, _ = select.select([conn], [], [], 0)
            assert not readable, "the server closed (or wrote to) the idle connection"
            assert _get_health(conn, server.port).startswith(b"HTTP/1.1 200")
