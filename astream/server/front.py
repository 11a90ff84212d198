"""The server's one public port. Requests under /v1/ (the OpenAI API) are answered here;
everything else (websocket handshakes, /health, /metrics) is relayed byte for byte to the
websocket server, which listens on a private socket behind it.

Why a relay: the `websockets` server reads only GET handshakes, never a request body, and
its public API cannot adopt a connection whose first bytes were already read. Relaying
keeps the websocket endpoint exactly as it was (handshake checks, frame limits, close
codes); the cost is one local socket hop per websocket connection. An ASGI stack would
also serve both, but would replace that tested endpoint wholesale; docs/PROTOCOL.md says
more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import tempfile

from astream.server.http11 import HttpConnection, HttpError
from astream.server.openai_routes import OpenAIRoutes

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup          # anyio's dependency there

_RELAY_CHUNK = 65536
log = logging.getLogger("astream.server")


class HttpFront:
    def __init__(self, routes: OpenAIRoutes) -> None:
        self.routes = routes
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._private: str | None = None

    @property
    def backend_path(self) -> str:
        """Where the websocket server listens: a socket in a fresh 0700 folder of this user."""
        if self._private is None:
            self._private = tempfile.mkdtemp(prefix="astream-")
        return os.path.join(self._private, "ws.sock")

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._connection, host, port)
        return self._server.sockets[0].getsockname()[1]

    def stop_listening(self) -> None:
        if self._server is not None:
            self._server.close()

    async def close(self) -> None:
        """Close every connection still open (after the websocket server closed its own)."""
        for writer in list(self._writers):
            writer.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        if self._private is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.backend_path)
            with contextlib.suppress(OSError):
                os.rmdir(self._private)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        conn = HttpConnection(reader, writer)
        try:
            while (head := await conn.read_head()) is not None:
                if not head.path.startswith("/v1/"):
                    await self._relay(conn, head.raw + bytes(conn.buffered))
                    return
                if not await self.routes.handle(conn, head):
                    return
        except HttpError as exc:
            with contextlib.suppress(OSError):
                await conn.send(exc.status, f"{exc.message}\n".encode(), "text/plain",
                                (("Connection", "close"),))
        except Exception as exc:
            if not _went_away(exc):               # a bug: this connection ends, the server lives
                log.exception("HTTP connection failed")
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _relay(self, conn: HttpConnection, first: bytes) -> None:
        try:
            reader, writer = await asyncio.open_unix_connection(self.backend_path)
        except OSError:
            return                                # the websocket server is closing
        writer.write(first)
        upstream = asyncio.ensure_future(_pipe(conn.reader, writer, half_close=True))
        try:
            await _pipe(reader, conn.writer, half_close=False)
        finally:
            upstream.cancel()
            writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, half_close: bool) -> None:
    """Copy until EOF; then pass the EOF on (half_close) so the peer can finish its side."""
    try:
        while data := await reader.read(_RELAY_CHUNK):
            writer.write(data)
            await writer.drain()
        if half_close and writer.can_write_eof():
            writer.write_eof()
    except (OSError, asyncio.IncompleteReadError):
        pass



def _went_away(exc: BaseException) -> bool:
    """A client that left or never finished its request (maybe inside a task group's group)."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_went_away(inner) for inner in exc.exceptions)
    return isinstance(exc, (OSError, TimeoutError))
