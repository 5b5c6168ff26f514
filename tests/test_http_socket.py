"""The HTTP listening socket makes connections that send small writes at once.

asyncio turns Nagle's algorithm off only on sockets that say they are TCP; a socket made
with proto 0 kept it on, and each response's last small write then waited for the client's
delayed ACK: non-streamed responses took 48 ms instead of 4.6 ms (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import socket

from tokenizer_proc.__main__ import _bind


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
