"""Incremental detokenization and stop conditions for one request.

Text is released only in whole characters: while the newest tokens end in an
incomplete UTF-8 sequence the decoder shows U+FFFD, and nothing is emitted until
the character completes. With stop strings, text that could still grow into a
stop string is held back, so a caller never sees part of one.
"""

from __future__ import annotations

from dataclasses import dataclass

from astream.base.sampling import SamplingParams
from astream.text.stop_matcher import StopMatcher

try:
    from tokenizers.decoders import DecodeStream
except ImportError:                                  # tokenizers < 0.21
    DecodeStream = None

_CONTEXT_TOKENS = 4     # prompt tokens decoded before the output, for correct leading spaces


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Token ids in, text out, one token at a time.

    With a fast (Rust) tokenizer this steps a `tokenizers` DecodeStream: one call per
    token that holds back incomplete characters itself. Otherwise it decodes a small
    sliding window twice per token and compares.
    """

    tokenizer: object
    ids: list[int]
    prefix_offset: int
    read_offset: int
    stream: object = None            # tokenizers.decoders.DecodeStream, when available
    backend: object = None           # the tokenizers.Tokenizer it steps with

    @classmethod
    def start(cls, tokenizer, prompt_ids: list[int]) -> "IncrementalDetokenizer":
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        detok = cls(tokenizer, context, 0, len(context))
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and DecodeStream is not None:
            detok.stream, detok.backend = DecodeStream(skip_special_tokens=True), backend
            for token_id in context:                 # prime it: leading spaces depend on context
                detok.stream.step(backend, token_id)
        return detok

    def push(self, token_id: int) -> str:
        if self.stream is not None:
            return self.stream.step(self.backend, token_id) or ""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return after[len(before):]

    def flush(self) -> str:
        """Complete text still held back; a trailing incomplete character is dropped."""
        if self.stream is not None:
            return ""                                # the stream holds back only partial characters
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:]).rstrip("\ufffd")
        self.prefix_offset = self.read_offset = len(self.ids)
        return after[len(before):] if len(after) > len(before) else ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


@dataclass(slots=True)
class RequestText:
    """Turns one completion's token ids into released text, and decides why it ends.

    `finished` is the completion's finish reason: the one place it is kept (the request's
    record reads it from here). The detokenizer is given once the prompt is tokenized.
    """

    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    eos_ids: frozenset[int]
    held: str = ""               # decoded text not released yet: it may begin a stop string
    released: int = 0            # characters handed out so far
    finished: str | None = None
    stops: StopMatcher | None = None

    def __post_init__(self) -> None:
        if self.params.stop and self.stops is None:
            self.stops = StopMatcher.build(self.params.stop)

    def append(self, token_id: int, at_limit: bool) -> str:
        """Add one token; return newly released text. Sets `finished` when it ends.
        `at_limit`: the completion has its max_tokens, or its sequence max_model_len (the
        caller counts tokens: the sequence holds them)."""
        params = self.params
        if token_id in params.stop_token_ids or (token_id in self.eos_ids and not params.ignore_eos):
            self.finished = "stop"
            return self._release(self.held)
        piece = self.detokenizer.push(token_id)
        if self.stops is not None:
            return self._append_with_stops(piece, at_limit)
        if at_limit:
            self.finished = "length"
            piece += self.detokenizer.flush()
        self.released += len(piece)          # without stop strings nothing is ever held
        return piece

    def finish_early(self, reason: str) -> str:
        """End the request from outside (abort, error): release what is complete."""
        self.finished = reason
        return self._release(self.held)

    def _append_with_stops(self, piece: str, at_limit: bool) -> str:
        text = self.held + piece             # starts at character `released` of all text
        stop_at = self.stops.feed(piece)
        if stop_at is not None:
            self.finished = "stop"
            return self._release(text[:max(stop_at - self.released, 0)])
        if at_limit:
            self.finished = "length"
            return self._release(text + self.detokenizer.flush())
        keep = min(self.stops.held, len(text))
        self.held = text[len(text) - keep:]
        return self._release(text[:len(text) - keep], keep_held=True)

    def _release(self, chunk: str, keep_held: bool = False) -> str:
        if not keep_held:
            self.held = ""
        self.released += len(chunk)
        return chunk
