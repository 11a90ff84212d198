"""Per-request sampling parameters, validated when constructed.

Every field has a documented range (docs/PROTOCOL.md repeats it for the wire). A value
that passes here can always become a device tensor and never costs the engine time
out of proportion to the request: counts and lengths are bounded, floats are finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from astream.base.validation import is_unicode, short_repr

MAX_INT64 = 2**63 - 1
MAX_TOKENS_LIMIT = 2**31 - 1          # beyond any context a model has
MAX_TOKEN_ID = 2**31 - 1              # larger than every vocabulary
SEED_RANGE = (-(2**63), 2**64 - 1)    # any 64-bit pattern, signed or not
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20                     # alternatives a token may carry (OpenAI's limit)
MAX_N = 16                            # completions of one prompt
PENALTY_RANGE = (-2.0, 2.0)           # presence and frequency penalties
MAX_REPETITION_PENALTY = 2.0
GREEDY_BELOW = 1e-5                   # temperatures below this sample greedily
_MASK64 = (1 << 64) - 1


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How one request turns logits into tokens and when it stops.

    temperature 0 (or below 1e-5) means greedy. A seed makes sampling reproducible: the
    same prompt, params and seed give the same tokens whatever else is batched with it.
    top_k 0, or a value at least the vocabulary size, disables top-k.

    Penalties follow OpenAI (presence, frequency: over the generated tokens) and vLLM
    (repetition: over prompt and generated tokens). logprobs are those of the model's own
    distribution, before penalties, temperature, top-k and top-p (as vLLM reports them by
    default). With n > 1 the prompt is computed once and its KV shared by the n completions;
    with a seed, completion i samples from `choice_seed(seed, i)`.
    """

    temperature: float = field(default=1.0, metadata={
        "help": "sampling temperature, a finite number >= 0 (below 1e-5: greedy)"})
    top_p: float = field(default=1.0, metadata={
        "help": "nucleus sampling: keep the most likely tokens holding this much probability, in (0, 1]"})
    top_k: int = field(default=0, metadata={
        "help": "keep only the k most likely tokens, an integer >= 0 (0: all)"})
    seed: int | None = field(default=None, metadata={
        "help": "makes sampling reproducible, any 64-bit integer (unset: the engine's generator)"})
    max_tokens: int = field(default=256, metadata={
        "help": "most tokens to generate per completion, an integer in [1, 2^31)"})
    stop: tuple[str, ...] = field(default=(), metadata={
        "help": "strings that end the completion, at most 64 of at most 256 characters each"})
    stop_token_ids: tuple[int, ...] = field(default=(), metadata={
        "help": "token ids that end the completion, at most 256 integers in [0, 2^31)"})
    ignore_eos: bool = field(default=False, metadata={
        "help": "keep generating after the model's end-of-sequence token, true or false"})
    presence_penalty: float = field(default=0.0, metadata={
        "help": "subtracted from the logit of every token already generated, in [-2, 2]"})
    frequency_penalty: float = field(default=0.0, metadata={
        "help": "times a token's count in the output, subtracted from its logit, in [-2, 2]"})
    repetition_penalty: float = field(default=1.0, metadata={
        "help": "divides positive and multiplies negative logits of tokens in the prompt or "
                "output, in (0, 2] (1: off)"})
    min_tokens: int = field(default=0, metadata={
        "help": "tokens to generate before EOS or stop_token_ids may end it, in [0, max_tokens]"})
    logprobs: int | None = field(default=None, metadata={
        "help": "return each token's logprob and this many most likely alternatives, in "
                "[0, 20] (unset: none)"})
    n: int = field(default=1, metadata={
        "help": "completions to generate for the prompt, an integer in [1, 16]"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _as_tuple(self.stop, "stop", str))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids", None))
        _check(_is_finite(self.temperature) and self.temperature >= 0,
               f"temperature must be a finite number >= 0, got {self.temperature!r}")
        _check(_is_finite(self.top_p) and 0 < self.top_p <= 1,
               f"top_p must be a number in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and 0 <= self.top_k <= MAX_INT64,
               f"top_k must be an integer >= 0 and < 2^63 (0 disables it), got {short_repr(self.top_k)}")
        _check(_is_int(self.max_tokens) and 1 <= self.max_tokens <= MAX_TOKENS_LIMIT,
               f"max_tokens must be an integer >= 1 and < 2^31, got {short_repr(self.max_tokens)}")
        _check(self.seed is None or (_is_int(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]),
               f"seed must be null or an integer in [-2^63, 2^64), got {short_repr(self.seed)}")
        _check(isinstance(self.ignore_eos, bool), f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
               f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}")
        _check(all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in self.stop_token_ids),
               f"stop_token_ids must be integers in [0, 2^31), got {short_repr(self.stop_token_ids)}")
        _check(len(self.stop) <= MAX_STOP_STRINGS,
               f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1],
                   f"{name} must be a number in [-2, 2], got {short_repr(value)}")
        _check(_is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
               f"repetition_penalty must be a number in (0, 2], got {short_repr(self.repetition_penalty)}")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be an integer in [0, max_tokens], got {short_repr(self.min_tokens)}")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs must be null or an integer in [0, {MAX_LOGPROBS}], got {short_repr(self.logprobs)}")
        _check(_is_int(self.n) and 1 <= self.n <= MAX_N,
               f"n must be an integer in [1, {MAX_N}], got {short_repr(self.n)}")
        for s in self.stop:
            _check(0 < len(s) <= MAX_STOP_STRING_CHARS and is_unicode(s),
                   f"stop strings must be non-empty valid unicode of at most {MAX_STOP_STRING_CHARS} "
                   f"characters, got {short_repr(s)}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Some penalty changes the logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @classmethod
    def from_dict(cls, params: dict) -> "SamplingParams":
        """Build from a JSON-like dict; unknown keys raise ValueError naming them."""
        unknown = set(params) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown sampling params: {sorted(unknown)}; "
                             f"known: {sorted(cls.__dataclass_fields__)}")
        return cls(**params)


def choice_seed(seed: int, index: int) -> int:
    """The seed completion `index` of a request seeded `seed` samples from: the seed itself
    for the first, so n=1 is unchanged, and well-spread 64-bit values for the others."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _as_tuple(value: object, name: str, item_type: type | None) -> tuple:
    if item_type is str and isinstance(value, str):
        return (value,)
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list, got {type(value).__name__}")
    if item_type is str and not all(isinstance(s, str) for s in value):
        raise ValueError(f"{name} must hold only strings")
    return tuple(value)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_finite(x: object) -> bool:
    """A number a float can hold (an integer of 400 digits cannot)."""
    try:
        return _is_number(x) and math.isfinite(x)
    except OverflowError:
        return False


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
