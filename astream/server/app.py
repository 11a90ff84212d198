"""StreamServer: one running Engine served on one port by uvicorn, as one ASGI application
(Starlette): astream-ws/1 websockets, the OpenAI HTTP API under /v1, /health and /metrics,
with a graceful shutdown.

    async with Engine(...) as engine, StreamServer(engine, ServerOptions(port=0)) as server:
        print(server.url)
        ...                              # serve until told to stop
        await server.shutdown()          # drain, then abort what is left, then close 1001

Runs on asyncio (uvloop included): uvicorn is asyncio-only. If the engine stops after
an internal fault, the server keeps running: /health answers 503 with status
"engine_stopped", and every new request gets an `engine_error` frame or a 503.
"""

from __future__ import annotations

import itertools
import socket
from http import HTTPStatus

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from astream.engine.engine import Engine
from astream.server.guard import Refusal, refusal
from astream.server.http import JSON
from astream.server.listen import CLOSE_GRACE_S, bind, start
from astream.server.metrics import METRICS_CONTENT_TYPE, METRICS_PATH, metrics_registry, render
from astream.server.openai_routes import OpenAIRoutes, error_response
from astream.server.openai_schema import ApiError
from astream.server.options import ServerOptions
from astream.server.session import Session
from astream.server.state import ServerState

HEALTH_PATH = "/health"
_ABORT_GRACE_S = 5.0        # after aborting, time for relays to send their "abort" done frames
DEFAULT_SERVED_MODEL = "SmolLM2-135M-Instruct"     # the embedded model's id on /v1/models


class StreamServer:
    def __init__(self, engine: Engine, options: ServerOptions | None = None,
                 sock: socket.socket | None = None) -> None:
        """`sock`: a listening socket from `listen.bind` (the CLI binds before loading the
        model); by default one is bound on options.host and options.port on entry."""
        self.engine = engine
        self.options = options or ServerOptions()
        self.state = ServerState(engine, self.options,
                                 self.options.requests_per_connection(engine.config.max_num_seqs))
        self._sessions: set[Session] = set()
        self._serials = itertools.count(1)
        self._hurry: anyio.Event | None = None
        self.openai = OpenAIRoutes(self.state, self.options.served_model_name
                                   or engine.config.model or DEFAULT_SERVED_MODEL)
        self._registry = metrics_registry(self.state)
        self.app = Starlette(routes=[
            Route(HEALTH_PATH, self._health, methods=["GET"]),
            Route(METRICS_PATH, self._metrics, methods=["GET"]),
            *self.openai.routes(),
            WebSocketRoute("/{path:path}", self._websocket),
        ], exception_handlers={HTTPException: _http_error})
        self._sock = sock
        self._uvicorn: uvicorn.Server | None = None
        self._port = 0

    async def __aenter__(self) -> "StreamServer":
        self._hurry = anyio.Event()
        sock = self._sock or bind(self.options.host, self.options.port)
        self._port = sock.getsockname()[1]
        try:
            self._uvicorn = await start(self.app, self.options, sock)
        except BaseException:
            sock.close()
            raise
        return self

    async def __aexit__(self, *exc_info) -> None:
        # Shielded: leaving because of a cancellation must still close the listener and
        # the connections; the steps of shutdown() are bounded by timeouts.
        with anyio.CancelScope(shield=True):
            await self.shutdown(0 if exc_info[0] is not None else None)

    @property
    def closing(self) -> bool:
        return self.state.closing

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        host = self.options.host
        return f"ws://{f'[{host}]' if ':' in host else host}:{self.port}"

    def health(self) -> dict:
        return self.state.health()

    # ---- routes -------------------------------------------------------------------------

    async def _health(self, request: Request) -> Response:
        health = self.state.health()
        return JSON(health, status_code=200 if health["status"] == "ok" else 503)

    async def _metrics(self, request: Request) -> Response:
        refused = refusal(request.headers, self.options, check_origin=False)
        if refused is not None:
            return PlainTextResponse(refused.message + "\n", refused.status, refused.headers)
        return Response(render(self._registry), media_type=METRICS_CONTENT_TYPE)

    async def _websocket(self, ws: WebSocket) -> None:
        """The handshake's checks answer with an HTTP status before any websocket opens."""
        refused = refusal(ws.headers, self.options)
        if refused is None and self.state.connections >= self.options.max_connections:
            refused = Refusal(HTTPStatus.SERVICE_UNAVAILABLE, "too many connections; try again later")
        if refused is not None:
            await ws.send_denial_response(PlainTextResponse(refused.message + "\n", refused.status,
                                                            refused.headers))
            return
        await ws.accept()
        session = Session(ws, self.state, next(self._serials))
        self._sessions.add(session)
        self.state.connections += 1
        try:
            await session.run()
        finally:
            self.state.connections -= 1
            self._sessions.discard(session)

    # ---- shutdown -------------------------------------------------------------------------

    def hurry(self) -> None:
        """Cut the shutdown's grace period short (a second SIGINT/SIGTERM)."""
        if self._hurry is not None:
            self._hurry.set()

    async def shutdown(self, timeout: float | None = None) -> None:
        """Stop accepting, let live requests finish for `timeout` seconds (default: the
        server's shutdown_timeout), abort the rest, then close every connection with 1001."""
        if self._uvicorn is None:
            return
        server, self._uvicorn = self._uvicorn, None
        self.state.closing = True
        for listener in server.servers:          # open connections keep going
            listener.close()
        with anyio.move_on_after(self.options.shutdown_timeout if timeout is None else timeout):
            await self._wait_idle_or_hurry()
        for session in list(self._sessions):
            await session.abort_all()
        await self.openai.abort_all()
        with anyio.move_on_after(_ABORT_GRACE_S):
            await self.state.idle.wait()
        async with anyio.create_task_group() as closing:
            for session in list(self._sessions):
                closing.start_soon(session.close, CLOSE_GRACE_S)
        await server.shutdown()                  # bounded by its timeout_graceful_shutdown
        for connection in list(server.server_state.connections):
            connection.transport.abort()         # outlived the grace period: dropped

    async def _wait_idle_or_hurry(self) -> None:
        async with anyio.create_task_group() as group:
            async def wait(event: anyio.Event) -> None:
                await event.wait()
                group.cancel_scope.cancel()

            group.start_soon(wait, self.state.idle)
            group.start_soon(wait, self._hurry)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own refusals (no such route, wrong method) in the shape of their path."""
    if request.url.path.startswith("/v1/"):
        message = {404: f"no route {request.url.path}; astream serves /v1/models, "
                        "/v1/completions, /v1/chat/completions",
                   405: f"{request.url.path} does not take {request.method}"}.get(
                       exc.status_code, exc.detail)
        return error_response(ApiError(HTTPStatus(exc.status_code), message))
    return PlainTextResponse(f"{exc.detail}\n", exc.status_code, exc.headers)
