"""HTTP pieces the routes share, on top of Starlette: request bodies read within limits,
JSON that is always valid UTF-8, and responses that end when their client leaves.

uvicorn parses the wire (heads, Content-Length and chunked bodies, keep-alive,
`Connection: close`, HTTP/1.0, pipelining with flow control); what is left here is
policy: how much a body may hold and how long a client may take to send it.
"""

from __future__ import annotations

import sys
from http import HTTPStatus
from typing import Awaitable, Callable

import anyio
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from astream.server.protocol import encode as json_text

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup


class BodyError(Exception):
    """A body that is not read: too large, too slow, or cut off."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The whole body, refused (413) past `limit` bytes, before reading any when the
    Content-Length says so, and refused (408) when it takes longer than `timeout`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                        f"request body of {declared} bytes is above this server's {limit}")
    body = bytearray()
    with anyio.move_on_after(timeout) as waited:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise BodyError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                f"request body is above this server's {limit} bytes")
    if waited.cancelled_caught:
        raise BodyError(HTTPStatus.REQUEST_TIMEOUT, f"the request body took more than {timeout:g} s")
    return bytes(body)


class JSON(Response):
    media_type = "application/json"

    def render(self, content: dict) -> bytes:
        return json_text(content).encode("utf-8")


Produce = Callable[[Send], Awaitable[None]]


class WhileConnected(Response):
    """A response written by `produce(send)`, which is cancelled as soon as the client
    disconnects: a request whose client left stops at once, not at its next write."""

    def __init__(self, produce: Produce) -> None:
        self.produce = produce
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:
            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                group.cancel_scope.cancel()

            group.start_soon(watch)
            try:
                await self.produce(send)
            except (OSError, BaseExceptionGroup) as exc:
                if not client_left(exc):
                    raise
            group.cancel_scope.cancel()


def client_left(exc: BaseException) -> bool:
    """Whether `exc` only says the client went away mid-write (uvicorn's ClientDisconnected
    is an OSError), alone or from every task of a group (the SSE keepalive beside the
    tokens): nothing to report then."""
    if isinstance(exc, BaseExceptionGroup):
        return all(client_left(inner) for inner in exc.exceptions)
    return isinstance(exc, OSError)
