"""One websocket connection: many requests multiplexed by id, each relayed by its own task.

The receive loop parses frames and starts or cancels requests; a bad frame costs one
error frame and nothing else. When the connection ends, for any reason, the task
group is cancelled and every request still live on it is aborted, freeing its KV.

Every send can wait on a client that does not read (its socket full). The receive loop
is one of those senders, so such a client's frames are not read either, and TCP holds
it back; a disconnect ends every wait at once.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import anyio
from anyio.abc import TaskGroup
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketDisconnected

from astream.base.errors import EngineClosedError, PromptTooLongError
from astream.base.outputs import Progress, StreamToken
from astream.engine.request_stream import RequestStream
from astream.server import protocol as p
from astream.server.state import ServerState, admitted

GONE = (WebSocketDisconnect, WebSocketDisconnected, OSError)    # the connection is over
GOING_AWAY = 1001
log = logging.getLogger("astream.server")


@dataclass(slots=True)
class _Prefill:
    """What a request's progress heartbeat needs to know."""

    prefilled: int = 0
    total: int = 0
    last_sent: float = 0.0
    started: bool = False                # the first token went out: no more progress frames
    beat: anyio.CancelScope = field(default_factory=anyio.CancelScope)


class Session:
    def __init__(self, ws: WebSocket, server: ServerState, serial: int) -> None:
        self.ws = ws
        self.server = server
        self.serial = serial
        self.live: dict[str, str] = {}      # client request id -> engine request id
        self._numbers = itertools.count(1)
        self._tasks: TaskGroup | None = None

    async def run(self) -> None:
        async with anyio.create_task_group() as tasks:
            self._tasks = tasks
            try:
                while (message := await self.ws.receive())["type"] == "websocket.receive":
                    text = message.get("text")
                    await self._dispatch(text if text is not None else message.get("bytes", b""))
            except GONE:                      # 1009 (frame too large), network loss, ...
                pass
            finally:
                tasks.cancel_scope.cancel()   # relays abort their requests on the way out

    async def close(self, timeout: float) -> None:
        """End the connection with 1001 (going away); a client that does not read gets
        `timeout` seconds to take the close frame before its connection is dropped."""
        if self._tasks is not None:
            self._tasks.cancel_scope.cancel()
        with anyio.move_on_after(timeout):
            try:
                await self.ws.close(GOING_AWAY)
            except (*GONE, RuntimeError):
                pass

    async def abort_all(self) -> None:
        for engine_id in list(self.live.values()):
            await self.server.engine.abort(engine_id)

    # ---- client frames ------------------------------------------------------------------

    async def _dispatch(self, message: str | bytes) -> None:
        try:
            frame = p.parse_frame(message, self.server.options.max_tokens_cap)
            if isinstance(frame, p.Cancel):
                await self._cancel(frame.id)
            else:
                await self._start(frame)
        except p.FrameError as err:
            await self._send(p.error_frame(err.request_id, err.code, err.message))
        except Exception as exc:                   # a bug: report it, keep the connection
            log.exception("frame handling failed")
            await self._send(p.error_frame(None, p.INTERNAL, type(exc).__name__))

    async def _cancel(self, request_id: str) -> None:
        engine_id = self.live.get(request_id)
        if engine_id is None:
            raise p.FrameError(p.UNKNOWN_ID, f"no live request with id {request_id!r}", request_id)
        await self.server.engine.abort(engine_id)      # its relay sends the "abort" done frame

    async def _start(self, frame: p.Generate) -> None:
        if frame.id in self.live:
            raise p.FrameError(p.DUPLICATE_ID, f"request id {frame.id!r} is still live on this "
                               "connection", frame.id)
        if self.server.closing:
            raise p.FrameError(p.SHUTTING_DOWN, "the server is shutting down", frame.id)
        limit = self.server.requests_per_connection
        if len(self.live) >= limit:
            raise p.FrameError(p.TOO_MANY_REQUESTS, f"this connection already has {limit} live "
                               "requests, the server's limit", frame.id)
        # Unique per request, so a relay that ends late never mistakes a reused client id.
        engine_id = f"ws{self.serial}.{next(self._numbers)}/{frame.id}"
        try:
            request = await self.server.engine.request(frame.prompt, frame.params, engine_id,
                                                       progress=True, client=f"ws{self.serial}")
        except EngineClosedError as exc:
            raise p.FrameError(p.ENGINE_ERROR, str(exc), frame.id) from None
        except PromptTooLongError as exc:          # refused by size, before tokenization
            raise p.FrameError(p.PROMPT_TOO_LONG, str(exc), frame.id) from None
        except ValueError as exc:                  # the engine still holds this id
            raise p.FrameError(p.DUPLICATE_ID, str(exc), frame.id) from None
        self.live[frame.id] = engine_id
        self.server.request_started()
        self._tasks.start_soon(self._relay, frame.id, request,
                               frame.params.max_tokens if frame.asked_max_tokens else 1,
                               name=f"relay {engine_id}")

    # ---- one request's frames -----------------------------------------------------------

    async def _relay(self, request_id: str, request: RequestStream, max_tokens: int) -> None:
        prefill = _Prefill(last_sent=anyio.current_time())
        self._tasks.start_soon(self._heartbeat, request_id, request, prefill)
        try:
            async with request:                    # leaving early aborts the request
                first = await admitted(request)
                overflow = isinstance(first, Progress) and \
                    self.server.context_overflow(request.prompt_tokens, max_tokens)
                if overflow:
                    self._end(request_id, request)
                    await self._send(p.error_frame(request_id, p.PROMPT_TOO_LONG, overflow))
                    return
                if isinstance(first, Progress):    # admitted: no frame, the heartbeat has its total
                    prefill.total = first.total
                else:
                    await self._forward(request_id, request, first, prefill)
                async for item in request:
                    await self._forward(request_id, request, item, prefill)
        except ValueError as exc:                  # the engine rejected the prompt
            self._end(request_id, request)
            await self._send_quietly(p.error_frame(request_id, _prompt_error_code(exc), str(exc)))
        except GONE:
            pass
        except Exception as exc:                   # a bug: this request fails, the connection lives
            log.exception("relay of request %s failed", request_id)
            self._end(request_id, request)
            await self._send_quietly(p.error_frame(request_id, p.INTERNAL, f"{type(exc).__name__}"))
        finally:
            prefill.beat.cancel()
            self._end(request_id, request)

    async def _forward(self, request_id: str, request: RequestStream, item: StreamToken | Progress,
                       prefill: _Prefill) -> None:
        if isinstance(item, Progress):
            prefill.prefilled, prefill.total = item.prefilled, item.total
            if not prefill.started:
                prefill.last_sent = anyio.current_time()
                await self._send(p.progress_frame(request_id, item.prefilled, item.total))
            return
        prefill.started = True
        if item.token_id >= 0 or item.text:
            await self._send(p.token_frame(request_id, item))
        if item.finish_reason is None:
            return
        self._end(request_id, request)             # before the last frame: the id may be reused at once
        if item.finish_reason == "error":
            await self._send(p.error_frame(request_id, p.ENGINE_ERROR, item.error or "request failed"))
        else:
            await self._send(p.done_frame(request_id, item.finish_reason, request.prompt_tokens,
                                          request.completion_tokens, request.timing()))

    async def _heartbeat(self, request_id: str, request: RequestStream, prefill: _Prefill) -> None:
        """Progress at least every progress_interval until the first token (prefill may be slow)."""
        interval = self.server.options.progress_interval
        with prefill.beat:
            while not prefill.started:
                await anyio.sleep(max(0.0, prefill.last_sent + interval - anyio.current_time()))
                if prefill.started or anyio.current_time() - prefill.last_sent < interval:
                    continue
                prefill.last_sent = anyio.current_time()
                total = prefill.total or request.prompt_tokens
                if total:                          # 0: not tokenized yet, nothing to report
                    await self._send_quietly(p.progress_frame(request_id, prefill.prefilled, total))

    def _end(self, request_id: str, request: RequestStream) -> None:
        if self.live.get(request_id) == request.request_id:
            del self.live[request_id]
            self.server.request_ended()

    async def _send(self, frame: dict) -> None:
        await self.ws.send_text(p.encode(frame))

    async def _send_quietly(self, frame: dict) -> None:
        try:
            await self._send(frame)
        except GONE:
            pass


def _prompt_error_code(exc: ValueError) -> str:
    return p.PROMPT_TOO_LONG if isinstance(exc, PromptTooLongError) else p.INVALID_PROMPT
