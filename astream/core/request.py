"""One live request: the one record of everything about it (docs/ENGINE.md, "One record
per request").

    Request                  request_id, params, client; prompt_token_ids once tokenized;
                             timing; the output channel (`sink`)
      choices[i]             one per completion, n of them from the moment it opens
        seq: Sequence        its tokens, blocks and scheduling state (the scheduler's view)
        text: RequestText    its detokenizer, stop state and finish reason

Each fact is kept in one field and read from there. A completion's finish reason is
`choice.text.finished`, its token count `len(choice.seq.output_token_ids)`; the request's
finish reason and counts are derived from its choices, never stored beside them. The
core owns every record (`EngineCore.requests`) and is the only code that starts or ends
one. Output goes through a `RequestSink`, which the async engine implements with a
per-request channel, and synchronous callers with a plain list.

A request asking for n completions holds n choices, each a sequence of its own with its
own text state; they share the prompt's KV (see EngineCore.admit) and its token list.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from astream.base.outputs import Progress, StreamToken, TokenLogprob
from astream.base.sampling import SamplingParams
from astream.core.sequence import Sequence
from astream.text.request_text import RequestText


class RequestSink(Protocol):
    """Where one request's output goes. Called on the thread that drives the core, with the
    request's record, which the sink reads and never writes (the engine's channel stamps
    its delivery times: `first_token_at`, `last_token_at`)."""

    def token(self, request: "Request", token_id: int, text: str, finish_reason: str | None,
              error: str | None = None, choice: int = 0, logprob: TokenLogprob | None = None) -> bool:
        """One output token of completion `choice` (token_id -1: text released without a
        token, at the end). A finish_reason ends that choice; the request ends when each of
        its n choices has ended (`request.done`). Returns False when the consumer is gone."""

    def progress(self, request: "Request", prefilled: int, total: int) -> None:
        """Prefill progress of a long prompt."""

    def reject(self, request: "Request", error: Exception) -> None:
        """The request failed before producing anything (a bad prompt)."""

    @property
    def backlog(self) -> int:
        """Tokens delivered and not yet read by the consumer."""


@dataclass(slots=True, eq=False)
class Choice:
    """One of a request's completions. `seq` comes once the prompt is tokenized."""

    text: RequestText
    seq: Sequence | None = None

    @property
    def finished(self) -> bool:
        return self.text.finished is not None

    @property
    def finish_reason(self) -> str | None:
        return self.text.finished

    @property
    def num_tokens(self) -> int:
        """Tokens it generated that reached the host."""
        return 0 if self.seq is None else len(self.seq.output_token_ids)


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    params: SamplingParams
    sink: RequestSink
    choices: list[Choice]                                   # n of them
    client: str = ""
    prompt_token_ids: list[int] | None = None               # once tokenized
    forks: list[Sequence] = field(default_factory=list)     # choices waiting for the prompt's KV
    last_ended: int = -1                                    # the choice that ended last
    submitted_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None                         # its first step was formed (the core)
    first_token_at: float | None = None                     # delivery times, stamped by the
    last_token_at: float | None = None                      # engine's channel (stages.channel)

    @property
    def seq(self) -> Sequence | None:
        """The first choice's sequence, once admitted: the one that computes the prompt."""
        return self.choices[0].seq

    @property
    def done(self) -> bool:
        """Every choice has finished."""
        return not self.forks and all(choice.finished for choice in self.choices)

    @property
    def finish_reason(self) -> str | None:
        """Why the request ended (the reason of the choice that ended last); None while live."""
        return self.choices[self.last_ended].text.finished if self.done else None

    @property
    def prompt_tokens(self) -> int:
        return 0 if self.prompt_token_ids is None else len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        """Tokens generated over all choices."""
        return sum(choice.num_tokens for choice in self.choices)

    @property
    def paused(self) -> bool:
        """A consumer that fell behind made the scheduler hold back some choice (read-only here)."""
        return any(choice.seq is not None and choice.seq.paused for choice in self.choices)

    @property
    def queued(self) -> float | None:
        """Seconds from submission to the first step that computed the prompt; None before."""
        return None if self.started_at is None else self.started_at - self.submitted_at

    def timing(self) -> dict:
        """Time to first token, mean time per later token, and the time queued (from
        submission to the first step that computed the prompt; the rest of the time to
        first token is that step and the ones before it in flight), in milliseconds."""
        queue = None if self.queued is None else self.queued * 1e3
        if self.first_token_at is None:
            return {**no_timing(), "queue_ms": queue}
        later = self.completion_tokens - 1
        tpot = (self.last_token_at - self.first_token_at) / later * 1e3 if later > 0 else None
        return {"ttft_ms": (self.first_token_at - self.submitted_at) * 1e3, "tpot_ms": tpot,
                "queue_ms": queue}


@dataclass(slots=True)
class ListSink:
    """A sink for synchronous callers: keeps every item in order."""

    items: list = field(default_factory=list)
    error: Exception | None = None
    next_index: int = 0                  # the stream's item numbers

    def token(self, request: Request, token_id: int, text: str, finish_reason: str | None,
              error: str | None = None, choice: int = 0, logprob: TokenLogprob | None = None) -> bool:
        self.items.append(stream_token("", self.next_index, token_id, text, finish_reason, error,
                                       choice, logprob))
        self.next_index += 1
        return True

    def progress(self, request: Request, prefilled: int, total: int) -> None:
        self.items.append(Progress("", prefilled, total))

    def reject(self, request: Request, error: Exception) -> None:
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


def no_timing() -> dict:
    """Request.timing() before a first token: every figure None."""
    return {"ttft_ms": None, "tpot_ms": None, "queue_ms": None}
