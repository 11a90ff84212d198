"""Scoring an answer: which expected items it states, as whole tokens.

The rule: the generated text is split into maximal runs of digits (for numbers), of
letters, digits and underscores (for variable names) or of letters (for words, compared in
lower case); an expected item counts as found when one run equals it exactly. So the key
48213 is found in "The pass key is 48213." but not in "148213" or "4821". A trial is correct
when every expected item is found; its score is the share found (multi-value, variable
tracking and the aggregation tasks ask for several items). Accuracy is the mean
score over trials, as RULER's string-match-all: for one-answer tasks it is exact match.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterable

from astream.eval.problem import NAME, NUMBER, WORD

_RUNS = MappingProxyType({NUMBER: re.compile(r"\d+"), NAME: re.compile(r"\w+"),
                          WORD: re.compile(r"[^\W\d_]+")})


@dataclass(slots=True, frozen=True)
class Verdict:
    found: tuple[str, ...]
    score: float
    correct: bool


def extract(text: str, kind: str) -> list[str]:
    """The whole numbers (or names, or words in lower case) of `text`, in order."""
    try:
        pattern = _RUNS[kind]
    except KeyError:
        raise ValueError(f"unknown answer kind {kind!r}; use one of {', '.join(map(repr, _RUNS))}") from None
    runs = pattern.findall(text)
    return [run.lower() for run in runs] if kind == WORD else runs


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
