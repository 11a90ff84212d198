"""Per-request output channels: delivery, backpressure and the final token.

Each request owns an unbounded memory stream, but the engine counts what sits
unread in it. When a consumer falls `buffer_tokens` behind, its sequence is
paused: it keeps its KV blocks and its place, but is not scheduled until the
consumer has read half of the backlog. Other requests never wait for it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from astream.core import TokenEvent
from astream.outputs import StreamToken


@dataclass(slots=True, frozen=True)
class Progress:
    """Prefill progress of a long prompt (not a token)."""

    request_id: str
    prefilled: int
    total: int


@dataclass(slots=True, frozen=True)
class Rejected:
    """The first and only item of a request that failed before producing anything."""

    error: Exception


@dataclass(slots=True)
class RequestHandle:
    request_id: str
    send: MemoryObjectSendStream
    receive: MemoryObjectReceiveStream
    submitted_at: float = field(default_factory=time.perf_counter)
    prompt_tokens: int = 0
    next_index: int = 0
    tokens_sent: int = 0                 # real tokens (the final marker of an abort is not one)
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reason: str | None = None
    seq: object | None = None            # the Sequence, once admitted

    @property
    def backlog(self) -> int:
        return self.receive.statistics().current_buffer_used

    def timing(self) -> dict:
        """Time to first token and mean time per later token, in milliseconds."""
        if self.first_token_at is None:
            return {"ttft_ms": None, "tpot_ms": None}
        later = self.tokens_sent - 1
        tpot = (self.last_token_at - self.first_token_at) / later * 1e3 if later > 0 else None
        return {"ttft_ms": (self.first_token_at - self.submitted_at) * 1e3, "tpot_ms": tpot}


@dataclass(slots=True)
class RequestRegistry:
    buffer_tokens: int
    handles: dict[str, RequestHandle] = field(default_factory=dict)

    def open(self, request_id: str) -> RequestHandle:
        if request_id in self.handles:
            raise ValueError(f"request id {request_id!r} is already in use by a live request")
        send, receive = anyio.create_memory_object_stream(math.inf)
        handle = RequestHandle(request_id, send, receive)
        self.handles[request_id] = handle
        return handle

    def deliver(self, event: TokenEvent) -> bool:
        """Send one event to its request; False if the consumer is gone."""
        handle = self.handles.get(event.seq.request_id)
        if handle is None:
            return True
        now = time.perf_counter()
        if event.token_id >= 0:
            handle.first_token_at = handle.first_token_at or now
            handle.last_token_at = now
            handle.tokens_sent += 1
        token = StreamToken(handle.request_id, handle.next_index, event.token_id, event.text,
                            event.finish_reason, event.error)
        handle.next_index += 1
        try:
            handle.send.send_nowait(token)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return False
        if event.finish_reason is not None:
            self.close(handle, event.finish_reason)
        elif handle.backlog >= self.buffer_tokens:
            event.seq.paused = True
        return True

    def send_progress(self, request_id: str, prefilled: int, total: int) -> None:
        handle = self.handles.get(request_id)
        if handle is not None:
            try:
                handle.send.send_nowait(Progress(request_id, prefilled, total))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass

    def reject(self, handle: RequestHandle, error: Exception) -> None:
        """A request failed before producing anything: its consumer gets the exception."""
        self._send_final(handle, Rejected(error), "error")

    def end_unadmitted(self, handle: RequestHandle, reason: str) -> None:
        """End a request the core never saw (aborted while queued, or shutdown)."""
        self._send_final(handle, StreamToken(handle.request_id, handle.next_index, -1, "", reason),
                         reason)

    def _send_final(self, handle: RequestHandle, item: object, reason: str) -> None:
        try:
            handle.send.send_nowait(item)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        self.close(handle, reason)

    def close(self, handle: RequestHandle, reason: str) -> None:
        handle.finish_reason = reason
        handle.send.close()
        self.handles.pop(handle.request_id, None)

    def resumable(self) -> list[RequestHandle]:
        """Paused requests whose consumers have caught up."""
        return [h for h in self.handles.values()
                if h.seq is not None and h.seq.paused and h.backlog <= self.buffer_tokens // 2]
