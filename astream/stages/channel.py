"""Per-request output channels: the engine's RequestSink, with delivery timing.

A channel keeps only what belongs to delivery (its queue, the stream's item numbers, the
engine's metrics); every fact about the request itself (finish reason, token counts,
timing) is in the request's record, which the core hands to each call.

Each request owns an unbounded output queue, but the core counts what sits unread
in it (`backlog`): when a consumer falls `stream_buffer_tokens` behind, its sequence
is paused, and resumed once the consumer has read half of the backlog. Other
requests never wait for it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from astream.base.metrics import EngineMetrics
from astream.base.outputs import Progress, TokenLogprob
from astream.core.request import Request, stream_token
from astream.stages.output_queue import OutputQueue

log = logging.getLogger("astream.requests")


@dataclass(slots=True, frozen=True)
class Rejected:
    """The first and only item of a request that failed before producing anything."""

    error: Exception


@dataclass(slots=True)
class RequestChannel:
    queue: OutputQueue = field(default_factory=OutputQueue)   # read by the request's consumer
    metrics: EngineMetrics | None = None
    next_index: int = 0                  # the stream's item numbers

    # ---- the RequestSink protocol (called by the core) ------------------------------------

    def token(self, request: Request, token_id: int, text: str, finish_reason: str | None,
              error: str | None = None, choice: int = 0, logprob: TokenLogprob | None = None) -> bool:
        if token_id >= 0:                    # a real token: stamp its delivery in the record
            now, last = time.perf_counter(), request.last_token_at
            first = last is None
            if first:
                request.first_token_at, last = now, request.submitted_at
            request.last_token_at = now
            if self.metrics is not None:
                self.metrics.token(now - last, first, request.queued if first else None)
        item = stream_token(request.request_id, self.next_index, token_id, text, finish_reason,
                            error, choice, logprob)
        self.next_index += 1
        if finish_reason is not None and not request.done:
            return self.queue.put(item)          # the request goes on with its other choices
        return self._put(request, item, finish_reason)

    def progress(self, request: Request, prefilled: int, total: int) -> None:
        self._put(request, Progress(request.request_id, prefilled, total), None)

    def reject(self, request: Request, error: Exception) -> None:
        self._put(request, Rejected(error), "error")

    @property
    def backlog(self) -> int:
        return len(self.queue.items)

    def _put(self, request: Request, item: object, finish_reason: str | None) -> bool:
        if self.queue.closed:
            return False
        delivered = self.queue.put(item)     # False: the consumer left; the request still ends here
        if finish_reason is not None:
            self.queue.close()
            self._ended(request, finish_reason)
        return delivered

    def _ended(self, request: Request, reason: str) -> None:
        """Count the request and log one line for it (no prompt text)."""
        prompt = request.prompt_tokens
        if self.metrics is not None:
            self.metrics.finished(reason, prompt)
        if not log.isEnabledFor(logging.INFO):
            return
        timing = request.timing()
        ttft = "-" if timing["ttft_ms"] is None else f"{timing['ttft_ms']:.0f} ms"
        queued = "-" if timing["queue_ms"] is None else f"{timing['queue_ms']:.0f} ms"
        rate = "-" if not timing["tpot_ms"] else f"{1e3 / timing['tpot_ms']:.1f} tok/s"
        log.info("request %s %s: prompt %d tokens, generated %d, ttft %s (queued %s), decode %s",
                 request.request_id, reason, prompt, request.completion_tokens, ttft, queued, rate)
