"""Per-request output channels: the engine's RequestSink, with delivery timing.

Each request owns an unbounded output queue, but the core counts what sits unread
in it (`backlog`): when a consumer falls `stream_buffer_tokens` behind, its sequence
is paused, and resumed once the consumer has read half of the backlog. Other
requests never wait for it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from astream.base.metrics import EngineMetrics
from astream.base.outputs import Progress, TokenLogprob
from astream.core.request import stream_token
from astream.stages.output_queue import OutputQueue

log = logging.getLogger("astream.requests")


@dataclass(slots=True, frozen=True)
class Rejected:
    """The first and only item of a request that failed before producing anything."""

    error: Exception


@dataclass(slots=True)
class RequestChannel:
    request_id: str
    queue: OutputQueue = field(default_factory=OutputQueue)   # read by the request's consumer
    submitted_at: float = field(default_factory=time.perf_counter)
    next_index: int = 0
    choices: int = 1                     # completions the request makes (its n)
    choices_ended: int = 0
    tokens_sent: int = 0                 # real tokens (the final marker of an abort is not one)
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reason: str | None = None
    metrics: EngineMetrics | None = None
    prompt_tokens: Callable[[], int] = lambda: 0     # counted when the request ends

    @classmethod
    def open(cls, request_id: str, metrics: EngineMetrics | None = None,
             choices: int = 1) -> "RequestChannel":
        return cls(request_id, metrics=metrics, choices=choices)

    # ---- the RequestSink protocol (called by the core) ------------------------------------

    def token(self, token_id: int, text: str, finish_reason: str | None,
              error: str | None = None, choice: int = 0, logprob: TokenLogprob | None = None) -> bool:
        now = time.perf_counter()
        if token_id >= 0:
            first = self.first_token_at is None
            if self.metrics is not None and self.finish_reason is None:
                self.metrics.token(now - (self.submitted_at if first else self.last_token_at), first)
            self.first_token_at = self.first_token_at or now
            self.last_token_at = now
            self.tokens_sent += 1
        item = stream_token(self.request_id, self.next_index, token_id, text, finish_reason, error,
                            choice, logprob)
        self.next_index += 1
        if finish_reason is not None:
            self.choices_ended += 1
            if self.choices_ended < self.choices:      # the request goes on with its other choices
                return self.queue.put(item)
        return self._put(item, finish_reason)

    def progress(self, prefilled: int, total: int) -> None:
        self._put(Progress(self.request_id, prefilled, total), None)

    def reject(self, error: Exception) -> None:
        self._put(Rejected(error), "error")

    @property
    def backlog(self) -> int:
        return len(self.queue.items)

    # ---- consumer side ----------------------------------------------------------------------

    def timing(self) -> dict:
        """Time to first token and mean time per later token, in milliseconds."""
        if self.first_token_at is None:
            return {"ttft_ms": None, "tpot_ms": None}
        later = self.tokens_sent - 1
        tpot = (self.last_token_at - self.first_token_at) / later * 1e3 if later > 0 else None
        return {"ttft_ms": (self.first_token_at - self.submitted_at) * 1e3, "tpot_ms": tpot}

    def _put(self, item: object, finish_reason: str | None) -> bool:
        if self.finish_reason is not None:
            return False
        delivered = self.queue.put(item)     # False: the consumer left; the request still ends here
        if finish_reason is not None:
            self.finish_reason = finish_reason
            self.queue.close()
            self._ended(finish_reason)
        return delivered

    def _ended(self, reason: str) -> None:
        """Count the request and log one line for it (no prompt text)."""
        prompt = self.prompt_tokens()
        if self.metrics is not None:
            self.metrics.finished(reason, prompt)
        if not log.isEnabledFor(logging.INFO):
            return
        timing = self.timing()
        ttft = "-" if timing["ttft_ms"] is None else f"{timing['ttft_ms']:.0f} ms"
        rate = "-" if not timing["tpot_ms"] else f"{1e3 / timing['tpot_ms']:.1f} tok/s"
        log.info("request %s %s: prompt %d tokens, generated %d, ttft %s, decode %s",
                 self.request_id, reason, prompt, self.tokens_sent, ttft, rate)
