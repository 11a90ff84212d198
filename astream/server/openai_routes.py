"""The OpenAI routes: /v1/models, /v1/completions and /v1/chat/completions, streamed as
server-sent events or answered whole.

The same rules as a websocket handshake guard every route (one Authorization and one
Origin header; the API key when one is set; otherwise no browser Origin that is not
allowed), and the same limits hold: max_tokens_cap, the frame size as the body size, no
new requests while draining. A client that goes away mid-request aborts it, which frees
its KV, exactly like a websocket disconnect.
"""

from __future__ import annotations

import itertools
import time
from http import HTTPStatus

import anyio

from astream.errors import EngineClosedError, PromptTooLongError
from astream.outputs import Progress, StreamToken
from astream.request_stream import RequestStream
from astream.server.http import authorized
from astream.server.http11 import HttpConnection, HttpError, RequestHead, json_text
from astream.server.openai_schema import (
    ApiError, ApiRequest, ResponseShape, models_list, parse_request, usage,
)
from astream.server.state import ServerState

ROUTES = {"/v1/chat/completions": True, "/v1/completions": False}     # path -> chat
_CLOSE = (("Connection", "close"),)


class OpenAIRoutes:
    def __init__(self, state: ServerState, served_model: str) -> None:
        self.state = state
        self.served_model = served_model
        self.created = int(time.time())
        self.live: set[str] = set()             # engine ids of the requests running here
        self._numbers = itertools.count(1)

    async def handle(self, conn: HttpConnection, head: RequestHead) -> bool:
        """Answer one request; False when the connection must close after it (an error can
        leave an unread body behind)."""
        try:
            # The body first, whatever the answer: one left unread would reset the connection
            # under the response.
            limit = self.state.options.max_frame_bytes
            body = await conn.read_body(head, limit) if head.method == "POST" or \
                head.get("content-length") is not None else b""
            self._guard(head)
            if head.path == "/v1/models":
                _expect(head, "GET")
                await conn.send_json(HTTPStatus.OK, models_list(self.served_model, self.created))
                return True
            chat = ROUTES.get(head.path)
            if chat is None:
                raise ApiError(HTTPStatus.NOT_FOUND, f"no route {head.path}; astream serves "
                               f"/v1/models, {', '.join(ROUTES)}")
            _expect(head, "POST")
            request = parse_request(body, chat, self.served_model, self.state.options.max_tokens_cap)
            await self._run(conn, request)
            return True
        except HttpError as exc:
            await conn.send_json(exc.status, ApiError(exc.status, exc.message).body(), _CLOSE)
        except ApiError as exc:
            headers = _CLOSE + ((("WWW-Authenticate", 'Bearer realm="astream"'),)
                                if exc.status == HTTPStatus.UNAUTHORIZED else ())
            await conn.send_json(exc.status, exc.body(), headers)
        return False

    async def abort_all(self) -> None:
        for engine_id in list(self.live):
            await self.state.engine.abort(engine_id)

    def _guard(self, head: RequestHead) -> None:
        options = self.state.options
        authorization, origins = head.get_all("authorization"), head.get_all("origin")
        if len(authorization) > 1 or len(origins) > 1:
            raise ApiError(HTTPStatus.BAD_REQUEST, "send at most one Authorization and one Origin "
                           "header")
        if options.api_key is not None:
            if len(authorization) != 1 or not authorized(authorization[0], options.api_key):
                raise ApiError(HTTPStatus.UNAUTHORIZED, "missing or wrong API key: send "
                               "'Authorization: Bearer KEY'", code="invalid_api_key")
        elif origins and origins[0] not in options.allowed_origins:
            raise ApiError(HTTPStatus.FORBIDDEN, "requests from this Origin are not allowed (see "
                           "--allowed-origin)")

    async def _run(self, conn: HttpConnection, request: ApiRequest) -> None:
        state = self.state
        if state.closing:
            raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, "the server is shutting down")
        if len(self.live) >= state.options.max_connections:
            raise ApiError(HTTPStatus.TOO_MANY_REQUESTS, f"{len(self.live)} HTTP requests are "
                           "running, this server's limit (max_connections); try again later")
        engine_id = f"http{next(self._numbers)}"
        try:
            stream = await state.engine.request(request.prompt, request.params, engine_id,
                                                progress=True, client=engine_id)
        except EngineClosedError as exc:
            raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc)) from None
        except PromptTooLongError as exc:
            raise ApiError(HTTPStatus.BAD_REQUEST, str(exc), "prompt", "context_length_exceeded") from None
        self.live.add(engine_id)
        state.request_started()
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(_cancel_when_gone, conn, group.cancel_scope)
                async with stream:                   # leaving early aborts the request
                    if request.stream:
                        await _send_events(conn, request, stream, state.options.progress_interval)
                    else:
                        await _send_whole(conn, request, stream)
                group.cancel_scope.cancel()
        finally:
            self.live.discard(engine_id)
            state.request_ended()


async def _cancel_when_gone(conn: HttpConnection, scope: anyio.CancelScope) -> None:
    await conn.watch()
    scope.cancel()


async def _send_whole(conn: HttpConnection, request: ApiRequest, stream: RequestStream) -> None:
    pieces, last = [], None
    async for item in stream:
        if isinstance(item, StreamToken):
            pieces.append(item.text)
            last = item
            if item.finish_reason is not None:
                break
    if last is None or last.finish_reason in ("error", "abort"):
        raise ApiError(HTTPStatus.INTERNAL_SERVER_ERROR if last and last.finish_reason == "error"
                       else HTTPStatus.SERVICE_UNAVAILABLE,
                       (last.error if last else None) or "the request was aborted")
    body = ResponseShape(request).whole("".join(pieces), last.finish_reason,
                                        usage(stream.prompt_tokens, stream.completion_tokens))
    await conn.send_json(HTTPStatus.OK, body)


async def _send_events(conn: HttpConnection, request: ApiRequest, stream: RequestStream,
                       interval: float) -> None:
    """Chunks as tokens come; until the first, an SSE comment with the prefill's progress at
    least every `interval` seconds (clients skip comments; proxies see a live stream)."""
    shape, lock = ResponseShape(request), anyio.Lock()
    progress = {"prefilled": 0, "total": 0, "started": False}

    async def send(text: str) -> None:
        async with lock:
            await conn.send_event(text)

    async def keepalive() -> None:
        while not progress["started"]:
            await anyio.sleep(interval)
            if not progress["started"]:
                await send(_comment(progress))

    await conn.start_events()
    if request.chat:
        await send(_data(shape.chunk("", first=True)))
    async with anyio.create_task_group() as group:
        group.start_soon(keepalive)
        async for item in stream:
            if isinstance(item, Progress):
                progress.update(prefilled=item.prefilled, total=item.total)
                await send(_comment(progress))
                continue
            progress["started"] = True
            if item.text:
                await send(_data(shape.chunk(item.text)))
            if item.finish_reason is not None:
                await send(_final(shape, item, stream))
                break
        group.cancel_scope.cancel()
    await send("data: [DONE]\n\n")
    async with lock:
        await conn.end_events()


def _final(shape: ResponseShape, item: StreamToken, stream: RequestStream) -> str:
    if item.finish_reason in ("error", "abort"):
        status = HTTPStatus.INTERNAL_SERVER_ERROR if item.finish_reason == "error" else \
            HTTPStatus.SERVICE_UNAVAILABLE
        return _data(ApiError(status, item.error or "the request was aborted").body())
    text = _data(shape.chunk(None, item.finish_reason))
    if shape.request.include_usage:
        text += _data(shape.usage_chunk(usage(stream.prompt_tokens, stream.completion_tokens)))
    return text


def _data(payload: dict) -> str:
    return f"data: {json_text(payload)}\n\n"


def _comment(progress: dict) -> str:
    return f": prefill {json_text({'prefilled': progress['prefilled'], 'total': progress['total']})}\n\n"


def _expect(head: RequestHead, method: str) -> None:
    if head.method != method:
        raise ApiError(HTTPStatus.METHOD_NOT_ALLOWED, f"{head.path} takes {method}, not {head.method}")
