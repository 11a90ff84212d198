"""What the engine hands back to callers: streamed tokens and finished completions."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class StreamToken:
    """One generated token as it leaves the engine.

    text is the new text since the previous token of the same request; it may be
    "" while a multi-byte character is incomplete, and the final token of a request
    also carries any text held back (an incomplete character or a partial stop string).
    """

    request_id: str
    index: int
    token_id: int
    text: str
    finish_reason: str | None = None   # None until the last token: "stop" | "length" | "abort" | "error"
    error: str | None = None


@dataclass(slots=True, frozen=True)
class Progress:
    """Prefill progress of a long prompt (not a token)."""

    request_id: str
    prefilled: int
    total: int


@dataclass(slots=True)
class Completion:
    """The result of one finished request."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error"
    error: str | None = None
