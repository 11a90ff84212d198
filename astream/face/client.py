"""A small async client for the astream-ws/1 protocol (asyncio, as websockets' client is).

    async with Client("ws://127.0.0.1:8765", api_key=None) as client:
        async for tok in client.stream("Once upon a time", max_tokens=32, temperature=0):
            print(tok.text, end="", flush=True)
        text, done = await client.generate([{"role": "user", "content": "Hi"}], max_tokens=16)

One connection carries any number of concurrent `stream()` / `generate()` calls: a
reader task dispatches frames by request id. Leaving a `stream()` loop early sends a
cancel frame and drains the request until its done frame, so the server frees it;
wrap the loop in `contextlib.aclosing(...)` to have that happen at once rather than
when the generator is garbage-collected.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import anyio
from anyio.abc import ObjectSendStream, TaskGroup
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

log = logging.getLogger("astream.client")

_CANCEL_DRAIN_S = 10.0


class ServerError(Exception):
    """An error frame from the server for one request (see docs/PROTOCOL.md for the codes)."""

    def __init__(self, code: str, message: str, request_id: str | None) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.request_id = code, message, request_id


@dataclass(slots=True, frozen=True)
class Token:
    index: int
    token_id: int | None          # None: text released without a token (end of an aborted request)
    text: str


class Client:
    def __init__(self, url: str, api_key: str | None = None, *, open_timeout: float = 10.0) -> None:
        self.url = url
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._open_timeout = open_timeout
        self._ws: ClientConnection | None = None
        self._group: TaskGroup | None = None
        self._inboxes: dict[str, ObjectSendStream] = {}
        self._ids = itertools.count(1)

    async def __aenter__(self) -> "Client":
        self._ws = await connect(self.url, additional_headers=self._headers, max_size=None,
                                 compression=None, open_timeout=self._open_timeout)
        self._group = anyio.create_task_group()
        await self._group.__aenter__()
        self._group.start_soon(self._read)
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self._ws.close()
        self._group.cancel_scope.cancel()
        await self._group.__aexit__(None, None, None)

    async def stream(self, prompt: str | list, *, on_progress: Callable[[int, int], None] | None = None,
                     **params) -> AsyncIterator[Token]:
        """Tokens of one request as the server sends them; raises ServerError on an error frame."""
        async with aclosing(self._frames(prompt, params)) as frames:
            async for frame in frames:
                if frame["type"] == "token":
                    yield Token(frame["index"], frame["token_id"], frame["text"])
                elif frame["type"] == "progress" and on_progress is not None:
                    on_progress(frame["prefilled"], frame["total"])

    async def generate(self, prompt: str | list, **params) -> tuple[str, dict]:
        """The whole text of one request and its done frame (usage, timing, finish_reason)."""
        text = ""
        async with aclosing(self._frames(prompt, params)) as frames:
            async for frame in frames:
                if frame["type"] == "token":
                    text += frame["text"]
                elif frame["type"] == "done":
                    return text, frame
        raise ConnectionError("the request ended without a done frame")

    async def _frames(self, prompt: str | list, params: dict) -> AsyncIterator[dict]:
        """Every frame of one request up to and including its done frame."""
        request_id = f"c{next(self._ids)}"
        send, receive = anyio.create_memory_object_stream(math.inf)
        self._inboxes[request_id] = send
        finished = False
        try:
            await self._send({"type": "generate", "id": request_id, **_prompt_field(prompt),
                              "params": _jsonable(params)})
            async for frame in receive:
                finished = frame["type"] in ("done", "error")
                if frame["type"] == "error":
                    raise ServerError(frame["code"], frame["message"], request_id)
                yield frame
                if finished:
                    return
            raise ConnectionError("the connection closed before the request finished")
        finally:
            if not finished:
                await self._cancel_and_drain(request_id, receive)
            self._inboxes.pop(request_id, None)

    async def _cancel_and_drain(self, request_id: str, receive) -> None:
        with anyio.move_on_after(_CANCEL_DRAIN_S, shield=True):
            try:
                await self._send({"type": "cancel", "id": request_id})
            except ConnectionClosed:
                return
            async for frame in receive:
                if frame["type"] in ("done", "error"):
                    return

    async def _send(self, frame: dict) -> None:
        await self._ws.send(json.dumps(frame))

    async def _read(self) -> None:
        try:
            async for message in self._ws:
                frame = json.loads(message)
                inbox = self._inboxes.get(frame.get("id"))
                if inbox is not None:
                    inbox.send_nowait(frame)
                elif frame.get("type") == "error":
                    log.warning("server error frame: %s", frame)
        except ConnectionClosed:
            pass
        finally:
            for inbox in self._inboxes.values():
                inbox.close()


def _prompt_field(prompt: str | list) -> dict:
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        return {"messages": prompt}
    return {"prompt": prompt}


def _jsonable(params: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()}
