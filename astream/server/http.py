"""Plain HTTP on the websocket port: GET /health, GET /metrics, and the checks of every
handshake.

/health answers anyone (a load balancer's probe). /metrics (Prometheus text format) asks
for the API key when one is set, as a websocket handshake does.

A handshake is refused with an HTTP status before any websocket opens: 400 for a
request with two Authorization or Origin headers, 503 when the server holds
`max_connections` already, 403 for a browser Origin that is not allowed (only
checked when no API key is set: with a key, the key is the guard), 401 without the key.
"""

from __future__ import annotations

import hmac
import json
from http import HTTPStatus
from typing import Awaitable, Callable

from websockets.asyncio.server import ServerConnection
from websockets.http11 import Request, Response

from astream.server.metrics import METRICS_CONTENT_TYPE, METRICS_PATH, metrics_registry, render
from astream.server.state import ServerState

HEALTH_PATH = "/health"

ProcessRequest = Callable[[ServerConnection, Request], Awaitable[Response | None]]


def make_process_request(state: ServerState) -> ProcessRequest:
    """websockets' process_request hook: answer /health, then guard the handshake."""

    registry = metrics_registry(state)

    async def process_request(connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.partition("?")[0]
        if path == HEALTH_PATH:
            health = state.health()
            status = HTTPStatus.OK if health["status"] == "ok" else HTTPStatus.SERVICE_UNAVAILABLE
            return json_response(connection, status, health)
        if path == METRICS_PATH:
            return _unauthorized(connection, request, state) or _metrics_response(connection, registry)
        return refusal(connection, request, state)

    return process_request


def refusal(connection: ServerConnection, request: Request, state: ServerState) -> Response | None:
    """The response refusing this handshake, or None to let it through."""
    options = state.options
    authorization = request.headers.get_all("Authorization")
    origins = request.headers.get_all("Origin")
    if len(authorization) > 1 or len(origins) > 1:
        return connection.respond(HTTPStatus.BAD_REQUEST, "send at most one Authorization and one "
                                  "Origin header\n")
    if state.connections >= options.max_connections:
        return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, "too many connections; try again "
                                  "later\n")
    if options.api_key is None:
        if origins and origins[0] not in options.allowed_origins:
            return connection.respond(HTTPStatus.FORBIDDEN, "websocket connections from this "
                                      "Origin are not allowed (see --allowed-origin)\n")
        return None
    return _unauthorized(connection, request, state)


def _unauthorized(connection: ServerConnection, request: Request, state: ServerState) -> Response | None:
    """401 when an API key is set and the request does not carry it (exactly once)."""
    api_key = state.options.api_key
    if api_key is None:
        return None
    authorization = request.headers.get_all("Authorization")
    if len(authorization) == 1 and authorized(authorization[0], api_key):
        return None
    response = connection.respond(HTTPStatus.UNAUTHORIZED,
                                  "missing or wrong API key: send 'Authorization: Bearer KEY'\n")
    response.headers["WWW-Authenticate"] = 'Bearer realm="astream"'
    return response


def _metrics_response(connection: ServerConnection, registry) -> Response:
    response = connection.respond(HTTPStatus.OK, render(registry).decode())
    del response.headers["Content-Type"]
    response.headers["Content-Type"] = METRICS_CONTENT_TYPE
    return response


def json_response(connection: ServerConnection, status: HTTPStatus, body: dict) -> Response:
    response = connection.respond(status, json.dumps(body) + "\n")
    del response.headers["Content-Type"]
    response.headers["Content-Type"] = "application/json"
    return response


def authorized(header: str | None, api_key: str) -> bool:
    scheme, _, token = (header or "").partition(" ")
    # compare_digest: the time taken must not reveal how much of the key matched.
    offered = token.strip().encode("utf-8", "surrogateescape")
    return scheme.lower() == "bearer" and hmac.compare_digest(offered, api_key.encode())
