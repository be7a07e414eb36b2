"""The listening socket `ferrum serve` binds (ferrum.server.serve.bind_socket) and the connections accepted on it."""

from __future__ import annotations

import asyncio
import socket

from ferrum.server.serve import bind_socket
from tests.live_server import free_port


def test_accepted_connections_send_small_writes_at_once() -> None:
    """Nagle's algorithm is off (TCP_NODELAY) on every connection the server accepts, as asyncio and uvicorn
    set it up on the socket: with it on, a kept-alive connection's streamed chunks waited for the client's
    delayed ACK and came 40-50 ms late, together (asyncio turns it off only on sockets whose protocol is TCP)."""

    async def accept_one() -> int:
        loop = asyncio.get_running_loop()
        sock = bind_socket("127.0.0.1", free_port())
        seen: asyncio.Future[int] = loop.create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                seen.set_result(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        server = await loop.create_server(Probe, sock=sock)
        try:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            nodelay = await asyncio.wait_for(seen, 10)
            writer.close()
            return nodelay
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(accept_one()) != 0
