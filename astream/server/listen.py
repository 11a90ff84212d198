"""The server's port and the uvicorn that serves it: every limit set explicitly.

The socket is bound before anything slow happens (`bind`), so `astream serve` on a busy
port fails at once instead of after loading a model. uvicorn then serves the ASGI app
on it: httptools where installed (else h11) for HTTP, and the `websockets` library's
Sans-I/O protocol for astream-ws/1 frames. Its limits come from ServerOptions. Three
guards are added here, for what uvicorn leaves open:
- a deadline on request heads: a client that opens a connection, or finishes a
  response, and then trickles a head byte by byte is dropped after `request_timeout`;
- pongs are written without waiting for the peer to read, so a peer that floods pings
  and never reads is dropped once MAX_UNREAD_BYTES wait unsent;
- a peer that misses the keepalive ping is dropped at once: it would not read a close
  frame either, and closing politely would wait on it for good.

And one for speed: every connection's writes during one turn of the event loop leave
in one system call (`_CoalescingTransport`). A stream that finds several tokens waiting
writes their frames or SSE events back to back, and each would otherwise cost a
`send()` of its own; under load that was most of the server's time per token.
"""

from __future__ import annotations

import asyncio
import errno
import importlib.util
import socket

import uvicorn
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from astream.server.options import ServerOptions

MAX_HEAD_BYTES = 16 * 1024           # h11's cap on an incomplete head (httptools has its own)
LISTEN_BACKLOG = 2048                # handshakes that may wait for accept() at once
WS_MAX_QUEUE = 16                    # received frames buffered before reading pauses
CLOSE_GRACE_S = 5.0                  # a connection's last seconds once shutdown closes it
MAX_UNREAD_BYTES = 2**20             # websocket bytes a peer leaves unread before it is dropped


class PortInUseError(OSError):
    """The address is taken (or not ours to bind); raised before any model is loaded."""


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PortInUseError(errno.EADDRNOTAVAIL, f"cannot resolve host {host!r}: {exc}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUseError(exc.errno, f"port {port} on {host} is already in use; stop the "
                                 "other server or choose another --port") from None
        raise PortInUseError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.setblocking(False)
    return sock


async def start(app, options: ServerOptions, sock: socket.socket) -> uvicorn.Server:
    """uvicorn serving `app` on `sock`, started (its listener accepting), signals untouched:
    the caller decides what SIGTERM does."""
    config = _config(app, options)
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    await server.startup(sockets=[sock])
    return server


def _config(app, options: ServerOptions) -> uvicorn.Config:
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    config = uvicorn.Config(
        app, lifespan="off", log_level="warning", access_log=False, server_header=False,
        http=_with_head_deadline(http, options.request_timeout), ws=_BoundedWebSocket,
        ws_max_size=options.max_frame_bytes, ws_max_queue=WS_MAX_QUEUE,
        ws_ping_interval=options.ping_interval, ws_ping_timeout=options.ping_timeout,
        ws_per_message_deflate=False,
        # Connections of both kinds: the websocket and HTTP limits are the app's, with room
        # for idle keep-alive connections; beyond this, uvicorn answers 503 itself.
        limit_concurrency=options.max_connections + options.max_http_requests + 64,
        timeout_keep_alive=options.keep_alive_timeout, h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        backlog=LISTEN_BACKLOG, timeout_graceful_shutdown=CLOSE_GRACE_S)
    config.load()
    return config


def _with_head_deadline(http: str, timeout: float) -> type[asyncio.Protocol]:
    base = uvicorn.config.import_from_string(uvicorn.config.HTTP_PROTOCOLS[http])

    class HeadDeadline(base):
        def connection_made(self, transport: asyncio.Transport) -> None:
            # The websocket protocol takes this transport over on upgrade, wrapper and all.
            super().connection_made(_CoalescingTransport(transport))
            self._arm_head_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_deadline()

        def _arm_head_deadline(self) -> None:
            self.loop.call_later(timeout, self._head_deadline, self.cycle)

        def _head_deadline(self, cycle_then: object) -> None:
            transport = self.transport
            if transport.is_closing() or transport.get_protocol() is not self:
                return                          # closed, or now a websocket
            if self.cycle is cycle_then:        # no new request head since the deadline was set
                transport.close()

    HeadDeadline.__name__ = HeadDeadline.__qualname__ = f"HeadDeadline{base.__name__}"
    return HeadDeadline


class _BoundedWebSocket(WebSocketsSansIOProtocol):
    def handle_ping(self) -> None:
        if self.transport.get_write_buffer_size() > MAX_UNREAD_BYTES:
            self.transport.abort()
            return
        super().handle_ping()

    def keepalive_timeout(self) -> None:
        super().keepalive_timeout()
        self.transport.abort()


class _CoalescingTransport:
    """A transport whose writes wait for the end of the event loop's turn, then leave as
    one write. Everything else goes to the real transport, after the pending bytes where
    order matters (close, write_eof); abort drops them."""

    __slots__ = ("_transport", "_pending", "_loop")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._pending: list[bytes] = []
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(data)

    def writelines(self, lines) -> None:
        for data in lines:
            self.write(data)

    def _flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)
