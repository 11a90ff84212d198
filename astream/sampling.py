"""Per-request sampling parameters, validated when constructed.

Every field has a documented range (docs/PROTOCOL.md repeats it for the wire). A value
that passes here can always become a device tensor and never costs the engine time
out of proportion to the request: counts and lengths are bounded, floats are finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from astream.validation import is_unicode, short_repr

MAX_INT64 = 2**63 - 1
MAX_TOKENS_LIMIT = 2**31 - 1          # beyond any context a model has
MAX_TOKEN_ID = 2**31 - 1              # larger than every vocabulary
SEED_RANGE = (-(2**63), 2**64 - 1)    # any 64-bit pattern, signed or not
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
GREEDY_BELOW = 1e-5                   # temperatures below this sample greedily


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How one request turns logits into tokens and when it stops.

    temperature 0 (or below 1e-5) means greedy. A seed makes sampling reproducible: the
    same prompt, params and seed give the same tokens whatever else is batched with it.
    top_k 0, or a value at least the vocabulary size, disables top-k.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

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
        for s in self.stop:
            _check(0 < len(s) <= MAX_STOP_STRING_CHARS and is_unicode(s),
                   f"stop strings must be non-empty valid unicode of at most {MAX_STOP_STRING_CHARS} "
                   f"characters, got {short_repr(s)}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @classmethod
    def from_dict(cls, params: dict) -> "SamplingParams":
        """Build from a JSON-like dict; unknown keys raise ValueError naming them."""
        unknown = set(params) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown sampling params: {sorted(unknown)}; "
                             f"known: {sorted(cls.__dataclass_fields__)}")
        return cls(**params)


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
