"""Scoring an answer: which expected items it states, as whole tokens.

The rule: the generated text is split into maximal runs of digits (for numbers) or of
letters, digits and underscores (for variable names); an expected item counts as found when
one run equals it exactly. So the key 48213 is found in "The pass key is 48213." but not in
"148213" or "4821". A trial is correct when every expected item is found; its score is the
share found (multi-value and variable tracking ask for several items). Accuracy is the mean
score over trials, as RULER's string-match-all: for one-answer tasks it is exact match.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterable

from astream.eval.problem import NAME, NUMBER

_RUNS = MappingProxyType({NUMBER: re.compile(r"\d+"), NAME: re.compile(r"\w+")})


@dataclass(slots=True, frozen=True)
class Verdict:
    found: tuple[str, ...]
    score: float
    correct: bool


def extract(text: str, kind: str) -> list[str]:
    """The whole numbers (or words) of `text`, in order."""
    try:
        pattern = _RUNS[kind]
    except KeyError:
        raise ValueError(f"unknown answer kind {kind!r}; use {NUMBER!r} or {NAME!r}") from None
    return pattern.findall(text)


def accuracy(scores: Iterable[float], empty: float = 0.0) -> float:
    """Mean score of some trials (`empty` when there are none)."""
    scores = list(scores)
    return sum(scores) / len(scores) if scores else empty


def score(answer: str, expected: tuple[str, ...], kind: str) -> Verdict:
    if not expected:
        raise ValueError("a trial needs at least one expected item")
    runs = set(extract(answer, kind))
    found = tuple(item for item in expected if item in runs)
    return Verdict(found, len(found) / len(expected), len(found) == len(expected))
