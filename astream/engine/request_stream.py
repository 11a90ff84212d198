"""RequestStream: one live request as its caller holds it (see Engine.request)."""

from __future__ import annotations

from typing import AsyncIterator, Awaitable, Callable, Protocol

from astream.base.outputs import Progress, StreamToken
from astream.base.sampling import SamplingParams
from astream.core.request import Request
from astream.text.tokenization import Prompt


class RequestStream:
    """Iterate it for StreamTokens (and Progress items when asked for).

    Closing it (aclose, or leaving `async with`) before the last token aborts the request,
    whether or not it was ever iterated. Its usage, finish reason and timing are read from
    the request's record.
    """

    def __init__(self, request: Request, items: AsyncIterator[StreamToken | Progress],
                 abort: Callable[[Request], None]) -> None:
        self._request = request
        self._items = items
        self._abort = abort

    @property
    def request_id(self) -> str:
        return self._request.request_id

    @property
    def prompt_tokens(self) -> int:
        return self._request.prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return list(self._request.prompt_token_ids or ())

    @property
    def completion_tokens(self) -> int:
        return self._request.completion_tokens

    @property
    def finish_reason(self) -> str | None:
        return self._request.finish_reason

    def timing(self) -> dict:
        """{"ttft_ms": ..., "tpot_ms": ...}; None where not yet measurable."""
        return self._request.timing()

    def __aiter__(self) -> "RequestStream":
        return self

    def __anext__(self) -> Awaitable[StreamToken | Progress]:
        return self._items.__anext__()          # the awaitable itself: no frame of our own per item

    async def aclose(self) -> None:
        self._abort(self._request)
        await self._items.aclose()

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()


class OpenStream(Protocol):
    """A request's open stream, as Engine.request and EngineProcess.request return it."""

    def __aiter__(self) -> AsyncIterator[StreamToken | Progress]: ...

    async def __aenter__(self) -> "OpenStream": ...

    async def __aexit__(self, *exc_info) -> None: ...


class RequestSource(Protocol):
    """What opens requests: an Engine, or an EngineProcess in front of one."""

    async def request(self, prompt: Prompt, params: SamplingParams | None = None,
                      request_id: str | None = None, *, progress: bool = False,
                      client: str = "") -> OpenStream: ...


async def stream_request(source: RequestSource, prompt: Prompt, params: SamplingParams | None,
                         request_id: str | None, progress: bool, client: str
                         ) -> AsyncIterator[StreamToken | Progress]:
    """`stream()` of Engine and EngineProcess: open the request at the first `anext`, yield
    its items, and close it (aborting it if still live) however the iteration ends."""
    request = await source.request(prompt, params, request_id, progress=progress, client=client)
    async with request:
        async for item in request:
            yield item
