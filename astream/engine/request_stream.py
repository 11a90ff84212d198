"""RequestStream: one live request as its caller holds it (see Engine.request)."""

from __future__ import annotations

from typing import AsyncIterator, Awaitable, Callable

from astream.base.outputs import Progress, StreamToken
from astream.core.request import Request
from astream.stages.channel import RequestChannel


class RequestStream:
    """Iterate it for StreamTokens (and Progress items when asked for).

    Closing it (aclose, or leaving `async with`) before the last token aborts the request,
    whether or not it was ever iterated.
    """

    def __init__(self, request: Request, channel: RequestChannel,
                 items: AsyncIterator[StreamToken | Progress], abort: Callable[[Request], None]) -> None:
        self._request = request
        self._channel = channel
        self._items = items
        self._abort = abort

    @property
    def request_id(self) -> str:
        return self._request.request_id

    @property
    def prompt_tokens(self) -> int:
        seq = self._request.seq
        return 0 if seq is None else seq.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        seq = self._request.seq
        return [] if seq is None else list(seq.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return self._channel.tokens_sent

    @property
    def finish_reason(self) -> str | None:
        return self._channel.finish_reason

    def timing(self) -> dict:
        """{"ttft_ms": ..., "tpot_ms": ...}; None where not yet measurable."""
        return self._channel.timing()

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
