"""Clients that try to hurt the server over the wire: each attack is reproduced against a
real server on a loopback port, and the server must stay up, keep its limits and give
back every connection slot, byte of memory it was made to hold, and KV block.

The attacks speak raw sockets (a small receive buffer, frames that are never read),
which no well-behaved client library would send.
"""

from __future__ import annotations

import json
import socket
import time

import anyio
import pytest
from websockets.asyncio.client import connect
from websockets.client import ClientProtocol
from websockets.uri import parse_uri

from server_helpers import health, http_exchange, serving, wait_idle

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", [("asyncio", {})])]

MODEL = "SmolLM2-135M-Instruct"
CANCEL_NOPE = json.dumps({"type": "cancel", "id": "nope"})    # each one costs an error frame


def raw_websocket(port: int, rcvbuf: int = 4096) -> tuple[socket.socket, ClientProtocol]:
    """A handshaken websocket on a blocking socket whose receive buffer is tiny."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    protocol = ClientProtocol(parse_uri(f"ws://127.0.0.1:{port}/"))
    protocol.send_request(protocol.connect())
    sock.sendall(b"".join(protocol.data_to_send()))
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)                         # byte by byte: leave the frames unread
    assert head.startswith(b"HTTP/1.1 101"), head
    protocol.receive_data(head)
    protocol.events_received()
    return sock, protocol


def flood(sock: socket.socket, protocol: ClientProtocol, frame, seconds: float) -> int:
    """Send frames (500 a write) without reading, for `seconds` or until the server stops
    taking them or drops the connection; returns the bytes the server took."""
    sock.settimeout(0.5)
    sent, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        for _ in range(500):
            frame(protocol)
        data = b"".join(protocol.data_to_send())
        try:
            sock.sendall(data)
        except (socket.timeout, OSError):
            return sent
        sent += len(data)
    return sent


async def connections(port: int, want: int, timeout: float = 15) -> dict:
    with anyio.fail_after(timeout):
        while (stats := await health(port))["connections"] != want:
            await anyio.sleep(0.05)
    return stats


async def test_clients_that_never_read_their_errors_give_their_slot_back():
    async with serving(max_connections=4) as srv:
        for _ in range(4):
            sock, protocol = await anyio.to_thread.run_sync(raw_websocket, srv.port)
            await anyio.to_thread.run_sync(flood, sock, protocol,
                                           lambda p: p.send_text(CANCEL_NOPE.encode()), 1.0)
            sock.close()
        await connections(srv.port, 0)
        async with connect(srv.url) as ws:                     # not refused with 503
            await ws.ping()


async def test_shutdown_finishes_while_clients_hold_connections_they_never_read():
    async with serving() as srv:
        held = []
        for _ in range(3):
            sock, protocol = await anyio.to_thread.run_sync(raw_websocket, srv.port)
            await anyio.to_thread.run_sync(flood, sock, protocol,
                                           lambda p: p.send_text(CANCEL_NOPE.encode()), 1.0)
            held.append(sock)
        await connections(srv.port, 3)
        with anyio.fail_after(20):
            await srv.shutdown(0)
        for sock in held:
            sock.close()


async def test_a_ping_flood_that_never_reads_is_dropped():
    async with serving() as srv:
        sock, protocol = await anyio.to_thread.run_sync(raw_websocket, srv.port)
        taken = await anyio.to_thread.run_sync(flood, sock, protocol,
                                               lambda p: p.send_ping(b"x" * 125), 20.0)
        sock.close()
        assert taken < 64 * 2**20                        # the server stopped taking pings
        await connections(srv.port, 0)


async def test_bytes_behind_a_streamed_request_are_not_buffered_without_limit():
    async with serving() as srv:
        body = json.dumps({"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 64,
                           "ignore_eos": True, "stream": True}).encode()
        request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)

        def send_then_pour() -> int:
            with socket.create_connection(("127.0.0.1", srv.port)) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.sendall(request + body)
                sock.settimeout(1.0)
                junk, poured = b"x" * 65536, 0
                try:
                    for _ in range(1600):                   # up to 100 MB
                        sock.sendall(junk)
                        poured += len(junk)
                except OSError:
                    pass
                return poured

        poured = await anyio.to_thread.run_sync(send_then_pour)
        assert poured < 32 * 2**20                       # reading paused: TCP held the client back
        await wait_idle(srv.port, srv.engine.stats()["kv_blocks_total"])


async def test_stalled_bodies_are_answered_and_closed():
    async with serving(api_key="s3cret", request_timeout=1.0) as srv:
        def stall(authorization: str) -> tuple[bytes, float]:
            start = time.monotonic()
            with socket.create_connection(("127.0.0.1", srv.port)) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10000\r\n"
                             + authorization.encode() + b"\r\n{\"mod")
                sock.settimeout(10)
                data = b""
                while chunk := sock.recv(65536):              # until the server closes
                    data += chunk
            return data, time.monotonic() - start

        async with anyio.create_task_group() as group:
            answers = []

            async def one(authorization: str) -> None:
                answers.append((authorization, *await anyio.to_thread.run_sync(stall, authorization)))

            for _ in range(20):
                group.start_soon(one, "")
            group.start_soon(one, "Authorization: Bearer s3cret\r\n")
        for authorization, data, took in answers:
            want = b" 408 " if authorization else b" 401 "       # no key: refused before the body
            assert want in data.split(b"\r\n", 1)[0], data[:200]
            assert took < 5
        assert (await health(srv.port))["status"] == "ok"


async def test_a_slow_head_is_dropped():
    async with serving(request_timeout=1.0) as srv:
        def trickle() -> float:
            start = time.monotonic()
            with socket.create_connection(("127.0.0.1", srv.port)) as sock:
                sock.settimeout(10)
                try:
                    for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
                        sock.sendall(bytes([byte]))
                        time.sleep(0.1)
                except OSError:
                    pass
                sock.recv(1)
            return time.monotonic() - start

        assert await anyio.to_thread.run_sync(trickle) < 4


async def test_200_handshakes_at_once_all_open():
    async with serving(max_connections=256) as srv:
        opened = []

        async def one() -> None:
            async with connect(srv.url, open_timeout=60) as ws:
                opened.append(ws)
                await ws.ping()

        async with anyio.create_task_group() as group:
            for _ in range(200):
                group.start_soon(one)
        assert len(opened) == 200


async def test_bad_values_get_a_400_not_silence():
    async with serving(max_frame_bytes=2**20) as srv:
        cases = [({"prompt": [99999999]}, "prompt"), ({"prompt": [99999999], "stream": True}, "prompt"),
                 ({"prompt": [2**70]}, "prompt"), ({"prompt": "x", "temperature": 10**400}, "temperature"),
                 ({"prompt": "x", "top_p": 10**400, "stream": True}, "top_p"),
                 ({"prompt": "x", "stop": ["s"] * 100_000}, "stop")]
        for fields, param in cases:
            body = json.dumps({"model": MODEL, **fields}).encode()
            status, head, text = await http_exchange(
                srv.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body) + body)
            assert status == 400, (fields, text[:300])
            assert json.loads(text)["error"]["param"] == param, (fields, text[:300])
        for length in ("\u00b2".encode(), b"9" * 5001):
            status, _, _ = await http_exchange(srv.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                               b"Content-Length: " + length + b"\r\n\r\n{}")
            assert status in (400, 413)
        async with connect(srv.url) as ws:
            await ws.send('{"type":"generate","id":"t","prompt":"hi","params":{"temperature":%s}}'
                          % ("9" * 400))
            error = json.loads(await ws.recv())
            assert (error["code"], error["id"]) == ("invalid_field", "t")
        assert (await health(srv.port))["status"] == "ok"


async def test_http_manners():
    async with serving() as srv:
        port = srv.port
        for request in (b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                        b"GET /health HTTP/1.0\r\n\r\n"):
            with anyio.fail_after(5):                          # answered, then closed by the server
                status, _, _ = await http_exchange(port, request)
            assert status == 200
        with anyio.fail_after(5):
            status, _, _ = await http_exchange(port, b"GET /health HTTP/1.1\nHost: x\nConnection: close\n\n")
        assert status in (200, 400)
        status, _, _ = await http_exchange(port, b"POST /health HTTP/1.1\r\nHost: x\r\n"
                                           b"Connection: close\r\nContent-Length: 0\r\n\r\n")
        assert status == 405
        body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2, "n": 1.0,
                           "presence_penalty": 0.0, "store": True, "metadata": {"a": "b"}}).encode()
        status, _, text = await http_exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                              b"Connection: close\r\nContent-Length: %d\r\n\r\n"
                                              % len(body) + body)
        assert status == 200, text
