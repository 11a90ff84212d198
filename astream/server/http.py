"""Plain HTTP on the websocket port: GET /health, and the API key check of every handshake."""

from __future__ import annotations

import hmac
import json
from http import HTTPStatus
from typing import Awaitable, Callable

from websockets.asyncio.server import ServerConnection
from websockets.http11 import Request, Response

HEALTH_PATH = "/health"

ProcessRequest = Callable[[ServerConnection, Request], Awaitable[Response | None]]


def make_process_request(api_key: str | None, health: Callable[[], dict]) -> ProcessRequest:
    """websockets' process_request hook: answer /health, refuse handshakes without the key."""

    async def process_request(connection: ServerConnection, request: Request) -> Response | None:
        if request.path.partition("?")[0] == HEALTH_PATH:
            return json_response(connection, HTTPStatus.OK, health())
        if api_key is not None and not _authorized(request.headers.get("Authorization"), api_key):
            response = connection.respond(HTTPStatus.UNAUTHORIZED,
                                          "missing or wrong API key: send 'Authorization: Bearer KEY'\n")
            response.headers["WWW-Authenticate"] = 'Bearer realm="astream"'
            return response
        return None

    return process_request


def json_response(connection: ServerConnection, status: HTTPStatus, body: dict) -> Response:
    response = connection.respond(status, json.dumps(body) + "\n")
    del response.headers["Content-Type"]
    response.headers["Content-Type"] = "application/json"
    return response


def _authorized(header: str | None, api_key: str) -> bool:
    scheme, _, token = (header or "").partition(" ")
    # compare_digest: the time taken must not reveal how much of the key matched.
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())
