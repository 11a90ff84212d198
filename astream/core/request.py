"""One live request as the core keeps it: its sequence, its text state, where its output goes.

The core owns every record (`EngineCore.requests`) and is the only code that ends one.
Output goes through a `RequestSink`, a small protocol the async engine implements
with a per-request stream, and synchronous callers with a plain list.

A request asking for n completions holds n choices, each a sequence of its own with its
own text state; they share the prompt's KV (see EngineCore.admit).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from astream.base.outputs import Progress, StreamToken, TokenLogprob
from astream.base.sampling import SamplingParams
from astream.core.sequence import Sequence
from astream.text.request_text import RequestText


class RequestSink(Protocol):
    """Where one request's output goes. Called on the thread that drives the core."""

    def token(self, token_id: int, text: str, finish_reason: str | None,
              error: str | None = None, choice: int = 0, logprob: TokenLogprob | None = None) -> bool:
        """One output token of completion `choice` (token_id -1: text released without a
        token, at the end). A finish_reason ends that choice; the request ends when each of
        its n choices has ended. Returns False when the consumer is gone."""

    def progress(self, prefilled: int, total: int) -> None:
        """Prefill progress of a long prompt."""

    def reject(self, error: Exception) -> None:
        """The request failed before producing anything (a bad prompt)."""

    @property
    def backlog(self) -> int:
        """Tokens delivered and not yet read by the consumer."""


@dataclass(slots=True, eq=False)
class Choice:
    """One of a request's completions: its sequence (seq.index is its place) and text."""

    seq: Sequence
    text: RequestText

    @property
    def finished(self) -> bool:
        return self.text.finished is not None


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    params: SamplingParams
    sink: RequestSink
    client: str = ""
    choices: list[Choice] = field(default_factory=list)     # once admitted, n of them
    forks: list[Sequence] = field(default_factory=list)     # choices waiting for the prompt's KV

    @property
    def seq(self) -> Sequence | None:
        """The first choice's sequence, once admitted: the one that computes the prompt."""
        return self.choices[0].seq if self.choices else None

    @property
    def text(self) -> RequestText | None:
        return self.choices[0].text if self.choices else None

    @property
    def done(self) -> bool:
        """Every choice has finished."""
        return not self.forks and all(choice.finished for choice in self.choices)

    @property
    def paused(self) -> bool:
        """A consumer that fell behind made the scheduler hold back some choice (read-only here)."""
        return any(choice.seq.paused for choice in self.choices)


@dataclass(slots=True)
class ListSink:
    """A sink for synchronous callers: keeps every item in order."""

    items: list = field(default_factory=list)
    error: Exception | None = None
    num_tokens: int = 0

    def token(self, token_id: int, text: str, finish_reason: str | None,
              error: str | None = None, choice: int = 0, logprob: TokenLogprob | None = None) -> bool:
        self.items.append(stream_token("", self.num_tokens, token_id, text, finish_reason, error,
                                       choice, logprob))
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


def stream_token(request_id: str, index: int, token_id: int, text: str, finish_reason: str | None,
                 error: str | None, choice: int, logprob: TokenLogprob | None) -> StreamToken:
    if logprob is None:
        return StreamToken(request_id, index, token_id, text, finish_reason, error, choice)
    return StreamToken(request_id, index, token_id, text, finish_reason, error, choice,
                       logprob.logprob, logprob.top)
