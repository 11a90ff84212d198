"""The OpenAI routes: /v1/models, /v1/completions and /v1/chat/completions, streamed as
server-sent events or answered whole.

The same rules as a websocket handshake guard every route, checked from the headers
before the body is read (one Authorization and one Origin header; the API key when one
is set; otherwise no browser Origin that is not allowed), and the same limits hold:
max_tokens_cap, the frame size as the body size, no new requests while draining. A
request is answered only once the engine has its prompt's length, so a prompt that does
not fit (alone, or with its max_tokens) gets a 400, never a stream cut short. A client
that goes away mid-request aborts it, which frees its KV, exactly like a websocket
disconnect.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from contextlib import AsyncExitStack
from http import HTTPStatus
from typing import Callable

import anyio
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Send

from astream.base.errors import EngineClosedError
from astream.base.outputs import CompletionOutput, Progress, StreamToken, TokenLogprob
from astream.engine.request_stream import RequestStream
from astream.runtime.events import run_off_loop
from astream.server.guard import http_client, refusal
from astream.server.http import JSON, BodyError, WhileConnected, json_text, read_body
from astream.server.openai_schema import (
    ApiError, ApiRequest, ResponseShape, models_list, parse_request, usage,
)
from astream.server.state import ServerState, admitted

log = logging.getLogger("astream.server")
Spell = Callable[[int], str]
ROUTES = {"/v1/chat/completions": True, "/v1/completions": False}     # path -> chat


class OpenAIRoutes:
    def __init__(self, state: ServerState, served_model: str) -> None:
        self.state = state
        self.served_model = served_model
        self.created = int(time.time())
        self.live: set[str] = set()             # engine ids of the requests running here
        self._numbers = itertools.count(1)
        self._spell: Spell | None = None        # made at the first request that asks for logprobs

    def routes(self) -> list[Route]:
        return [Route("/v1/models", self.models, methods=["GET"]),
                *(Route(path, self.completions, methods=["POST"]) for path in ROUTES)]

    async def abort_all(self) -> None:
        for engine_id in list(self.live):
            await self.state.engine.abort(engine_id)

    async def models(self, request: Request) -> Response:
        try:
            self._guard(request)
        except ApiError as exc:
            return error_response(exc)
        return JSON(models_list(self.served_model, self.created, self.state.max_model_len))

    async def completions(self, request: Request) -> Response:
        try:
            self._guard(request)
            api = await self._parse(request)
            return await self._start(request, api)
        except ApiError as exc:
            return error_response(exc)
        except Exception as exc:                    # a bug: this request fails, in the API's shape
            log.exception("%s failed before its response began", request.url.path)
            return error_response(ApiError(HTTPStatus.INTERNAL_SERVER_ERROR,
                                           f"internal error: {type(exc).__name__}", code="internal"))

    def _guard(self, request: Request) -> None:
        refused = refusal(request.headers, self.state.options)
        if refused is not None:
            raise ApiError(refused.status, refused.message, code=refused.code)

    async def _parse(self, request: Request) -> ApiRequest:
        state = self.state
        if state.closing:
            raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, "the server is shutting down")
        if len(self.live) >= state.options.max_http_requests:
            raise ApiError(HTTPStatus.TOO_MANY_REQUESTS, f"{len(self.live)} HTTP requests are "
                           "running, this server's limit (--max-http-requests); try again later")
        try:
            body = await read_body(request, state.options.max_frame_bytes,
                                   state.options.request_timeout)
        except BodyError as exc:
            raise ApiError(exc.status, exc.message) from None
        api = parse_request(body, ROUTES[request.url.path], self.served_model,
                            state.options.max_tokens_cap)
        if api.ignored:
            log.warning("ignored unknown field(s) of a %s request: %s", request.url.path,
                        ", ".join(api.ignored)[:200])
        return api

    async def _start(self, request: Request, api: ApiRequest) -> Response:
        """Submit, wait until the engine knows the prompt's length, then respond. Until the
        response takes over the stream, any failure here aborts the request."""
        state, engine_id = self.state, f"http{next(self._numbers)}"
        if state.closing:                       # a drain began while the body was read
            raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, "the server is shutting down")
        async with AsyncExitStack() as cleanup:
            try:
                stream = await state.engine.request(api.prompt, api.params, engine_id,
                                                    progress=True, client=http_client(request.client))
            except EngineClosedError as exc:
                raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc)) from None
            except ValueError as exc:                       # too large before tokenization
                raise _prompt_error(exc) from None
            cleanup.push_async_callback(stream.aclose)
            self.live.add(engine_id)
            state.request_started()
            cleanup.callback(self._ended, engine_id)
            try:
                first = await admitted(stream)
            except ValueError as exc:                       # refused after tokenization
                raise _prompt_error(exc) from None
            overflow = isinstance(first, Progress) and \
                state.context_overflow(stream.prompt_tokens, api.asked_max_tokens or 1)
            if overflow:
                raise ApiError(HTTPStatus.BAD_REQUEST, overflow, "messages" if api.chat else "prompt",
                               "context_length_exceeded")
            spell = await self._speller() if api.logprobs is not None else None
            produce = _events(api, stream, first, state.options.progress_interval, spell) \
                if api.stream else _whole(api, stream, first, spell)
            handed = cleanup.pop_all()                      # the response owns the request now

        async def respond(send: Send) -> None:
            async with handed:
                await produce(send)

        return WhileConnected(respond)

    async def _speller(self) -> Spell:
        """A token id's text, as logprobs name it (the model's own piece, cached), made once.
        An engine in another process loads its tokenizer here at the first use: off the loop."""
        if self._spell is None:
            tokenizer = await run_off_loop(lambda: self.state.engine.tokenizer)
            self._spell = functools.lru_cache(maxsize=65536)(
                lambda token_id: tokenizer.decode([token_id]))
        return self._spell

    def _ended(self, engine_id: str) -> None:
        self.live.discard(engine_id)
        self.state.request_ended()


def error_response(exc: ApiError) -> Response:
    headers = {"WWW-Authenticate": 'Bearer realm="astream"'} \
        if exc.status == HTTPStatus.UNAUTHORIZED else None
    return JSON(exc.body(), status_code=exc.status, headers=headers)


def _prompt_error(exc: ValueError) -> ApiError:
    from astream.base.errors import PromptTooLongError

    if isinstance(exc, PromptTooLongError):
        return ApiError(HTTPStatus.BAD_REQUEST, str(exc), "prompt", "context_length_exceeded")
    return ApiError(HTTPStatus.BAD_REQUEST, str(exc), "prompt", "invalid_prompt")


def _whole(api: ApiRequest, stream: RequestStream, first: StreamToken | Progress,
           spell: Spell | None):
    async def produce(send: Send) -> None:
        outputs = [CompletionOutput(index=i) for i in range(api.n)]
        ended = 0
        async for item in _items(first, stream):
            if isinstance(item, StreamToken):
                outputs[item.choice].add(item)
                ended += item.finish_reason is not None
                if ended == api.n:
                    break
        failed = next((o for o in outputs if o.finish_reason in (None, "error", "abort")), None)
        if failed is not None:
            error = ApiError(HTTPStatus.INTERNAL_SERVER_ERROR if failed.finish_reason == "error"
                             else HTTPStatus.SERVICE_UNAVAILABLE,
                             failed.error or "the request was aborted")
            await _send_json(send, error.status, error.body())
            return
        shape = ResponseShape(api)
        choices = [shape.choice(o.index, o.text, o.finish_reason,
                                None if api.logprobs is None else
                                logprobs_object(api.chat, o.logprobs or [], spell))
                   for o in outputs]
        await _send_json(send, HTTPStatus.OK,
                         shape.whole(choices, usage(stream.prompt_tokens, stream.completion_tokens)))

    return produce


def _events(api: ApiRequest, stream: RequestStream, first: StreamToken | Progress, interval: float,
            spell: Spell | None):
    """Chunks as tokens come; until the first, an SSE comment with the prefill's progress at
    least every `interval` seconds (clients skip comments; proxies see a live stream)."""
    async def produce(send: Send) -> None:
        shape, lock = ResponseShape(api), anyio.Lock()
        progress = {"prefilled": 0, "total": stream.prompt_tokens, "started": False}
        beat = anyio.CancelScope()               # the keepalive, until the first token
        # A token without text yet (half a character) sends no chunk: its logprob waits.
        pending: list[list[TokenLogprob]] = [[] for _ in range(api.n)]
        offsets = [0] * api.n                  # completions' text_offset runs on across chunks

        async def event(text: str, more: bool = True) -> None:
            # Only the keepalive sends beside the relay, and only until the first token: after
            # that no lock, whose acquiring would yield to the loop between queued tokens and
            # keep their events from leaving in one write.
            if progress["started"]:
                await send({"type": "http.response.body", "body": text.encode("utf-8"),
                            "more_body": more})
                return
            async with lock:
                await send({"type": "http.response.body", "body": text.encode("utf-8"),
                            "more_body": more})

        async def keepalive() -> None:
            with beat:
                while True:
                    await anyio.sleep(interval)
                    await event(_comment(progress))

        def logprobs(choice: int) -> dict | None:
            if api.logprobs is None:
                return None
            held, pending[choice] = pending[choice], []
            piece = logprobs_object(api.chat, held, spell, offsets[choice])
            if not api.chat:
                offsets[choice] += sum(len(token) for token in piece["tokens"])
            return piece

        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"cache-control", b"no-cache")]})
        if api.chat:
            for choice in range(api.n):
                await event(_data(shape.chunk(choice, "", first=True)))
        ended = 0
        async with anyio.create_task_group() as group:
            group.start_soon(keepalive)
            async for item in _items(first, stream):
                if isinstance(item, Progress):
                    progress.update(prefilled=item.prefilled, total=item.total)
                    await event(_comment(progress))
                    continue
                if not progress["started"]:
                    beat.cancel()
                    async with lock:             # a comment being written finishes first
                        progress["started"] = True
                if item.logprob is not None:
                    pending[item.choice].append(
                        TokenLogprob(item.token_id, item.logprob, item.top_logprobs or ()))
                if item.finish_reason in ("error", "abort"):
                    await event(_data(_failure(item).body()))
                    break
                if item.text:
                    await event(_data(shape.chunk(item.choice, item.text,
                                                  logprobs=logprobs(item.choice))))
                if item.finish_reason is not None:
                    await event(_data(shape.chunk(item.choice, None, item.finish_reason,
                                                  logprobs=logprobs(item.choice)
                                                  if pending[item.choice] else None)))
                    ended += 1
                    if ended == api.n:
                        if api.include_usage:
                            await event(_data(shape.usage_chunk(
                                usage(stream.prompt_tokens, stream.completion_tokens))))
                        break
            group.cancel_scope.cancel()
        await event("data: [DONE]\n\n", more=False)

    return produce


def logprobs_object(chat: bool, logprobs: list[TokenLogprob], spell: Spell, offset: int = 0) -> dict:
    """OpenAI's logprobs of a choice or chunk: chat's `content` list, or the completions
    API's parallel lists."""
    if chat:
        def entry(token_id: int, logprob: float) -> dict:
            text = spell(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(i, v) for i, v in lp.top]} for lp in logprobs]}
    tokens = [spell(lp.token_id) for lp in logprobs]
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset)) if tokens else []
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{spell(i): v for i, v in lp.top} for lp in logprobs],
            "text_offset": offsets}


async def _items(first: StreamToken | Progress, stream: RequestStream):
    yield first
    async for item in stream:
        yield item


async def _send_json(send: Send, status: HTTPStatus, payload: dict) -> None:
    body = json_text(payload).encode("utf-8")
    await send({"type": "http.response.start", "status": int(status),
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _failure(item: StreamToken) -> ApiError:
    status = HTTPStatus.INTERNAL_SERVER_ERROR if item.finish_reason == "error" else \
        HTTPStatus.SERVICE_UNAVAILABLE
    return ApiError(status, item.error or "the request was aborted")


def _data(payload: dict) -> str:
    return f"data: {json_text(payload)}\n\n"


def _comment(progress: dict) -> str:
    return f": prefill {json_text({'prefilled': progress['prefilled'], 'total': progress['total']})}\n\n"
