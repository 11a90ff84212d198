"""What one trial asks: the sentences hidden in the haystack, the question, the answer."""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Callable

NUMBER = "number"      # answers are whole numbers (keys, codes)
NAME = "name"          # answers are variable names (capital letters)
WORD = "word"          # answers are lowercase words, matched ignoring case

_ADJECTIVES = ("amber", "silver", "crimson", "quiet", "brave", "hollow", "golden", "misty", "rapid",
               "gentle", "frozen", "velvet", "copper", "lucky", "distant", "bright")
_NOUNS = ("otter", "falcon", "lantern", "harbor", "meadow", "comet", "willow", "anchor", "badger",
          "canyon", "maple", "pebble", "raven", "glacier", "orchid", "thistle")


@dataclass(slots=True, frozen=True)
class Insert:
    """A sentence placed in the haystack at `position` (0: first, 1: last) of the filler tokens."""

    position: float
    text: str


@dataclass(slots=True, frozen=True)
class Body:
    """A haystack that is the task's own text rather than filler: `text(size)` is a pure
    function whose text grows with `size`, from `smallest` up, and the prompt builder takes
    the largest size that fits the length."""

    text: Callable[[int], str]
    smallest: int = 1


@dataclass(slots=True, frozen=True)
class Problem:
    """One generated question. `expected` holds every item a correct answer must contain.
    With a `body`, the haystack is the body's text and there are no inserts."""

    intro: str
    question: str
    inserts: tuple[Insert, ...]
    expected: tuple[str, ...]
    kind: str
    max_tokens: int
    body: Body | None = None


def random_key(rng: random.Random, taken: set[str]) -> str:
    """A 5-to-7-digit number (the digit count is uniform), unlike every string in `taken`."""
    while True:
        digits = rng.randint(5, 7)
        key = str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))
        if key not in taken:
            taken.add(key)
            return key


def random_name(rng: random.Random, taken: set[str]) -> str:
    """An 'adjective-noun' label such as 'misty-otter', unlike every string in `taken`."""
    while True:
        name = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if name not in taken:
            taken.add(name)
            return name


def random_variable(rng: random.Random, taken: set[str]) -> str:
    """Five capital letters, e.g. 'QHZTK', unlike every string in `taken`."""
    while True:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in taken:
            taken.add(name)
            return name


def spread(rng: random.Random, count: int, low: float = 0.0, high: float = 1.0) -> list[float]:
    """`count` random positions in [low, high], sorted."""
    return sorted(rng.uniform(low, high) for _ in range(count))
