"""What the engine hands back to callers: streamed tokens and finished completions."""

from __future__ import annotations

from dataclasses import dataclass, field

TopLogprobs = tuple[tuple[int, float], ...]     # (token id, logprob), most likely first


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """A generated token's logprob and the most likely alternatives at its position.

    Natural logs of the model's own distribution (before penalties, temperature, top-k
    and top-p), so greedy tokens without penalties are always their position's top one.
    """

    token_id: int
    logprob: float
    top: TopLogprobs = ()


@dataclass(slots=True, frozen=True)
class StreamToken:
    """One generated token as it leaves the engine.

    text is the new text since the previous token of the same completion; it may be
    "" while a multi-byte character is incomplete, and the final token of a completion
    also carries any text held back (an incomplete character or a partial stop string).
    index counts the request's stream items; choice names the completion (0 to n-1) the
    token belongs to. A request with n completions ends after n final tokens, one per
    choice. logprob and top_logprobs are set when the request asked for logprobs (a
    final marker without a token, token_id -1, has none).
    """

    request_id: str
    index: int
    token_id: int
    text: str
    finish_reason: str | None = None   # None until the choice's last token: "stop" | "length" | "abort" | "error"
    error: str | None = None
    choice: int = 0
    logprob: float | None = None
    top_logprobs: TopLogprobs | None = None


@dataclass(slots=True, frozen=True)
class Progress:
    """Prefill progress of a long prompt (not a token)."""

    request_id: str
    prefilled: int
    total: int


@dataclass(slots=True)
class CompletionOutput:
    """One of a request's n completions."""

    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error"
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None    # one per token, when the request asked

    def add(self, token: StreamToken) -> None:
        """Fold in one streamed token of this completion."""
        if token.token_id >= 0:
            self.token_ids.append(token.token_id)
            if token.logprob is not None:
                if self.logprobs is None:
                    self.logprobs = []
                self.logprobs.append(TokenLogprob(token.token_id, token.logprob, token.top_logprobs or ()))
        self.text += token.text
        self.finish_reason, self.error = token.finish_reason, token.error


@dataclass(slots=True)
class Completion:
    """The result of one finished request: its n completions in `outputs`. The fields of
    the first one read directly off the Completion (`text`, `token_ids`, ...)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=lambda: [CompletionOutput()])

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def error(self) -> str | None:
        return self.outputs[0].error

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs
