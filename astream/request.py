"""One live request as the core keeps it: its sequence, its text state, where its output goes.

The core owns every record (`EngineCore.requests`) and is the only code that ends one.
Output goes through a `RequestSink`, a small protocol the async engine implements
with a per-request stream, and synchronous callers with a plain list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from astream.outputs import Progress, StreamToken
from astream.sampling import SamplingParams
from astream.sequence import Sequence
from astream.text import RequestText


class RequestSink(Protocol):
    """Where one request's output goes. Called on the thread that drives the core."""

    def token(self, token_id: int, text: str, finish_reason: str | None,
              error: str | None = None) -> bool:
        """One output token (token_id -1: text released without a token, at the end).
        Returns False when the consumer is gone."""

    def progress(self, prefilled: int, total: int) -> None:
        """Prefill progress of a long prompt."""

    def reject(self, error: Exception) -> None:
        """The request failed before producing anything (a bad prompt)."""

    @property
    def backlog(self) -> int:
        """Tokens delivered and not yet read by the consumer."""


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    params: SamplingParams
    sink: RequestSink
    client: str = ""
    seq: Sequence | None = None          # once admitted
    text: RequestText | None = None

    @property
    def paused(self) -> bool:
        """Its consumer fell behind and the scheduler holds it back (read-only here)."""
        return self.seq is not None and self.seq.paused


@dataclass(slots=True)
class ListSink:
    """A sink for synchronous callers: keeps every item in order."""

    items: list = field(default_factory=list)
    error: Exception | None = None
    num_tokens: int = 0

    def token(self, token_id: int, text: str, finish_reason: str | None,
              error: str | None = None) -> bool:
        self.items.append(StreamToken("", self.num_tokens, token_id, text, finish_reason, error))
        self.num_tokens += 1
        return True

    def progress(self, prefilled: int, total: int) -> None:
        self.items.append(Progress("", prefilled, total))

    def reject(self, error: Exception) -> None:
        self.error = error

    @property
    def backlog(self) -> int:
        return 0

    @property
    def tokens(self) -> list[StreamToken]:
        return [item for item in self.items if isinstance(item, StreamToken)]
