"""Just enough HTTP/1.1 for the OpenAI routes: request heads and bodies in, JSON and chunked
(server-sent events) responses out, and a watch that notices a client going away.

Bodies need a Content-Length (every OpenAI client sends one); anything beyond that is
refused with a status, never by dropping the connection silently.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from http import HTTPStatus

import anyio

MAX_HEAD_BYTES = 16 * 1024
HEAD_TIMEOUT_S = 30.0              # a client that never finishes its request head is dropped


class HttpError(Exception):
    """A request that gets `status` and a message instead of an answer."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(slots=True)
class RequestHead:
    method: str
    target: str                                  # as sent, query string included
    headers: list[tuple[str, str]]               # names lower-cased, in order, repeats kept
    raw: bytes                                   # the head as received, for a relay

    @property
    def path(self) -> str:
        return self.target.partition("?")[0]

    def get_all(self, name: str) -> list[str]:
        return [value for key, value in self.headers if key == name]

    def get(self, name: str) -> str | None:
        values = self.get_all(name)
        return values[0] if values else None


@dataclass(slots=True)
class HttpConnection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    buffered: bytearray = field(default_factory=bytearray)   # read past the current request

    async def read_head(self) -> RequestHead | None:
        """The next request head, or None when the client closed between requests."""
        with anyio.fail_after(HEAD_TIMEOUT_S):
            while (end := self.buffered.find(b"\r\n\r\n")) < 0:
                if len(self.buffered) > MAX_HEAD_BYTES:
                    raise HttpError(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "request head too large")
                data = await self.reader.read(65536)
                if not data:
                    if self.buffered:
                        raise HttpError(HTTPStatus.BAD_REQUEST, "connection closed mid-request")
                    return None
                self.buffered += data
        raw = bytes(self.buffered[:end + 4])
        del self.buffered[:end + 4]
        return _parse_head(raw)

    async def read_body(self, head: RequestHead, limit: int) -> bytes:
        if head.get("transfer-encoding") is not None:
            raise HttpError(HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length")
        lengths = head.get_all("content-length")
        if len(lengths) != 1 or not lengths[0].strip().isdigit():
            raise HttpError(HTTPStatus.LENGTH_REQUIRED, "send one numeric Content-Length")
        length = int(lengths[0])
        if length > limit:
            raise HttpError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                            f"request body of {length} bytes is above this server's {limit}")
        while len(self.buffered) < length:
            data = await self.reader.read(65536)
            if not data:
                raise HttpError(HTTPStatus.BAD_REQUEST, "connection closed mid-body")
            self.buffered += data
        body = bytes(self.buffered[:length])
        del self.buffered[:length]
        return body

    async def watch(self) -> None:
        """Read on while a request runs; return when the client closes its side. Anything
        read (a pipelined next request) is kept for `read_head`. Cancel it before that."""
        while data := await self.reader.read(65536):
            self.buffered += data

    async def send(self, status: HTTPStatus, body: bytes, content_type: str,
                   headers: tuple[tuple[str, str], ...] = ()) -> None:
        lines = [f"HTTP/1.1 {status.value} {status.phrase}", f"Content-Type: {content_type}",
                 f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in headers)]
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        await self.writer.drain()

    async def send_json(self, status: HTTPStatus, payload: dict,
                        headers: tuple[tuple[str, str], ...] = ()) -> None:
        await self.send(status, _json_bytes(payload), "application/json", headers)

    async def start_events(self) -> None:
        """Headers of a server-sent event stream, sent in chunks until `end_events`."""
        self.writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                          b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n")
        await self.writer.drain()

    async def send_event(self, text: str) -> None:
        data = text.encode("utf-8")
        self.writer.write(b"%x\r\n%s\r\n" % (len(data), data))
        await self.writer.drain()

    async def end_events(self) -> None:
        self.writer.write(b"0\r\n\r\n")
        await self.writer.drain()


def json_text(payload: dict) -> str:
    """JSON that is always valid UTF-8 (a lone surrogate is escaped, not sent raw)."""
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(payload, separators=(",", ":"))
    return text


def _json_bytes(payload: dict) -> bytes:
    return json_text(payload).encode("utf-8")


def _parse_head(raw: bytes) -> RequestHead:
    try:
        text = raw.decode("latin-1")
        request_line, *header_lines = text[:-4].split("\r\n")
        method, target, version = request_line.split(" ")
    except ValueError:
        raise HttpError(HTTPStatus.BAD_REQUEST, "malformed request line") from None
    if not version.startswith("HTTP/1."):
        raise HttpError(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, "HTTP/1.x only")
    headers = []
    for line in header_lines:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise HttpError(HTTPStatus.BAD_REQUEST, "malformed header line")
        headers.append((name.lower(), value.strip()))
    return RequestHead(method, target, headers, raw)
