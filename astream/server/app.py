"""StreamServer: one running Engine served on one port, over websockets (astream-ws/1) and
the OpenAI HTTP API, with a graceful shutdown.

    async with Engine(...) as engine, StreamServer(engine, ServerOptions(port=0)) as server:
        print(server.url)
        ...                              # serve until told to stop
        await server.shutdown()          # drain, then abort what is left, then close 1001

Runs on asyncio (uvloop included): websockets' server is asyncio-only. If the engine
stops after an internal fault, the server keeps running: /health answers 503 with
status "engine_stopped", and every new request gets an `engine_error` frame.
"""

from __future__ import annotations

import itertools

import anyio
from websockets.asyncio.server import Server, ServerConnection, unix_serve

from astream.engine import Engine
from astream.server.front import HttpFront
from astream.server.http import make_process_request
from astream.server.openai_routes import OpenAIRoutes
from astream.server.options import ServerOptions
from astream.server.session import Session
from astream.server.state import ServerState

_ABORT_GRACE_S = 5.0        # after aborting, time for relays to send their "abort" done frames
_TRY_AGAIN_LATER = 1013     # websocket close code for a server at its connection limit
DEFAULT_SERVED_MODEL = "SmolLM2-135M-Instruct"     # the embedded model's id on /v1/models


class StreamServer:
    def __init__(self, engine: Engine, options: ServerOptions | None = None) -> None:
        self.engine = engine
        self.options = options or ServerOptions()
        self.state = ServerState(engine, self.options,
                                 self.options.requests_per_connection(engine.config.max_num_seqs))
        self._sessions: set[Session] = set()
        self._serials = itertools.count(1)
        self._hurry: anyio.Event | None = None
        self.openai = OpenAIRoutes(self.state, self.options.served_model_name
                                   or engine.config.model or DEFAULT_SERVED_MODEL)
        self._front = HttpFront(self.openai)
        self._ws: Server | None = None
        self._port = 0

    async def __aenter__(self) -> "StreamServer":
        self._hurry = anyio.Event()
        self._ws = await unix_serve(self._handle, self._front.backend_path,
                                    process_request=make_process_request(self.state),
                                    max_size=self.options.max_frame_bytes, compression=None)
        try:
            self._port = await self._front.start(self.options.host, self.options.port)
        except BaseException:
            self._ws.close()
            await self._ws.wait_closed()
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

    async def _handle(self, ws: ServerConnection) -> None:
        if self.state.connections >= self.options.max_connections:   # raced past the handshake check
            await ws.close(_TRY_AGAIN_LATER, "too many connections")
            return
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
        if self._ws is None:
            return
        ws, self._ws = self._ws, None
        self.state.closing = True
        self._front.stop_listening()           # open connections keep going
        ws.server.close()
        with anyio.move_on_after(self.options.shutdown_timeout if timeout is None else timeout):
            await self._wait_idle_or_hurry()
        for session in list(self._sessions):
            await session.abort_all()
        await self.openai.abort_all()
        with anyio.move_on_after(_ABORT_GRACE_S):
            await self.state.idle.wait()
        ws.close()                             # code 1001, going away
        await ws.wait_closed()
        await self._front.close()

    async def _wait_idle_or_hurry(self) -> None:
        async with anyio.create_task_group() as group:
            async def wait(event: anyio.Event) -> None:
                await event.wait()
                group.cancel_scope.cancel()

            group.start_soon(wait, self.state.idle)
            group.start_soon(wait, self._hurry)
