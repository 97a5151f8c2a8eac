"""The server's TCP connections, owned here: hypercorn's HTTP protocol over bounded writes.

Why not `hypercorn.trio.serve`: hypercorn shields every socket write from cancellation
(`TCPServer.protocol_send`), so a client that stops reading holds its write, its request's
task, a graceful shutdown and even a second signal for as long as it likes; no timeout around
ASGI `send` can interrupt it. Here each accepted stream is a `BoundedStream`, whose writes
have their own deadline *inside* that shield (a cancel scope opened within a shielded one
still fires): a client that reads nothing for `write_timeout` seconds has its connection
closed, which hypercorn sees as a broken connection and the app as a disconnect (its
request is aborted in the engine). And every open connection is registered, so shutdown can
close them all: after the grace period, or at once when cancelled (a second signal).

What this takes from hypercorn beyond `serve` is its connection handler (`TCPServer`, the
HTTP/1.1 and HTTP/2 protocol) and its `WorkerContext`; the lifespan protocol is not run (the
app needs no start-up or shutdown hooks).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, cast

import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ASGIFramework, ConnectionState


class BoundedStream(trio.abc.HalfCloseableStream):
    """A socket stream whose writes give up after `write_timeout` seconds.

    A write that times out closes the connection and raises `trio.BrokenResourceError`:
    the client stopped reading, and the connection is of no further use.
    """

    def __init__(self, stream: trio.SocketStream, write_timeout: float) -> None:
        self.stream = stream
        self.socket = stream.socket  # hypercorn reads the peer's address from it
        self.write_timeout = write_timeout

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        with trio.move_on_after(self.write_timeout):
            await self.stream.send_all(data)
            return
        self.abort()
        raise trio.BrokenResourceError(
            f"the client read nothing for {self.write_timeout:g} s (--write-timeout): "
            f"its connection was closed"
        )

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.stream.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.stream.aclose()

    def abort(self) -> None:
        """Close the socket now: a read or write waiting on it fails at once (closed)."""
        self.socket.close()


class Connections:
    """Serves an ASGI app and owns its open connections."""

    def __init__(self, *, write_timeout: float) -> None:
        self.write_timeout = write_timeout
        self._open: set[BoundedStream] = set()
        self._closed = trio.lowlevel.ParkingLot()

    def abort_all(self) -> None:
        """Close every open connection now (their requests see a disconnect)."""
        for stream in list(self._open):
            stream.abort()

    async def serve(
        self,
        app: Callable[..., Awaitable[None]],
        config: HypercornConfig,
        *,
        shutdown_trigger: Callable[[], Awaitable[Any]],
    ) -> None:
        """Serve `app` on `config.bind` until `shutdown_trigger()` returns.

        Then: stop accepting, close idle keep-alive connections, give the others
        `config.graceful_timeout` seconds to finish, and close what is left. Cancelled, it
        closes every connection at once.
        """
        context = WorkerContext(None)
        handler = partial(self._handle, ASGIWrapper(cast(ASGIFramework, app)), config, context)
        sockets = config.create_sockets()
        listeners = []
        for sock in sockets.insecure_sockets:
            sock.listen(config.backlog)
            listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
        async with trio.open_nursery() as handlers:
            try:
                async with trio.open_nursery() as accepting:
                    accepting.start_soon(
                        partial(trio.serve_listeners, handler, listeners, handler_nursery=handlers)
                    )
                    await shutdown_trigger()
                    accepting.cancel_scope.cancel()
                for listener in listeners:
                    await listener.aclose()
                await context.terminated.set()  # idle keep-alive connections close now
                with trio.move_on_after(config.graceful_timeout):
                    while self._open:
                        await self._closed.park()
            finally:  # cancelled too: a shielded write would otherwise hold the nursery
                self.abort_all()

    async def _handle(
        self,
        app: ASGIWrapper,
        config: HypercornConfig,
        context: WorkerContext,
        stream: trio.SocketStream,
    ) -> None:
        bounded = BoundedStream(stream, self.write_timeout)
        self._open.add(bounded)
        try:
            server = TCPServer(app, config, context, ConnectionState({}), cast(Any, bounded))
            await server.run()
        finally:
            self._open.discard(bounded)
            self._closed.unpark_all()
