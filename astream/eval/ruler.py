"""RULER-style synthetic tasks, generated locally: each returns a Problem for one trial.

The sentence at `depth` is the one the question is about; the others are spread at random.
"""

from __future__ import annotations

import random

from astream.eval.problem import (NAME, NUMBER, Insert, Problem, random_key, random_name, random_variable,
                                  spread)

_CODE_INTRO = "Some secret codes are hidden in the text below. Read it carefully."
_VAR_INTRO = "Some variable assignments are hidden in the text below. Keep track of them."


def _code(name: str, value: str) -> str:
    return f"The secret code of the {name} is {value}."


def _codes(rng: random.Random, count: int) -> tuple[list[str], list[str]]:
    names: set[str] = set()
    values: set[str] = set()
    return ([random_name(rng, names) for _ in range(count)],
            [random_key(rng, values) for _ in range(count)])


def _single_code(rng: random.Random, depth: float, pairs: int) -> Problem:
    names, values = _codes(rng, pairs)
    others = [Insert(p, _code(n, v)) for p, n, v in zip(spread(rng, pairs - 1), names[1:], values[1:])]
    return Problem(intro=_CODE_INTRO,
                   question=f"What is the secret code of the {names[0]}? Answer with the number only.",
                   inserts=(Insert(depth, _code(names[0], values[0])), *others),
                   expected=(values[0],), kind=NUMBER, max_tokens=24)


def distractor(rng: random.Random, length: int, depth: float) -> Problem:
    """One needle and three distractor needles of the same form with other names."""
    return _single_code(rng, depth, pairs=4)


def multikey(rng: random.Random, length: int, depth: float) -> Problem:
    """The value of one key among many (one pair per 256 tokens of prompt, 8 to 64 pairs)."""
    return _single_code(rng, depth, pairs=min(64, max(8, length // 256)))


def multivalue(rng: random.Random, length: int, depth: float) -> Problem:
    """All four values of one key; two other keys with one value each are distractors."""
    names, values = _codes(rng, 6)
    key = names[0]
    mine = [Insert(p, f"One of the secret codes of the {key} is {v}.")
            for p, v in zip([depth, *spread(rng, 3)], values[:4])]
    others = [Insert(p, _code(n, v)) for p, n, v in zip(spread(rng, 2), names[4:], values[4:])]
    return Problem(intro=_CODE_INTRO,
                   question=f"What are all the secret codes of the {key}? Answer with the numbers only.",
                   inserts=(*mine, *others), expected=tuple(values[:4]), kind=NUMBER, max_tokens=64)


def vartrack(rng: random.Random, length: int, depth: float) -> Problem:
    """A chain of five assignments (A = 12345, B = A, ...) and a distractor chain of three."""
    taken: set[str] = set()
    chain = [random_variable(rng, taken) for _ in range(5)]
    decoy = [random_variable(rng, taken) for _ in range(3)]
    value, decoy_value = random_key(rng, set()), None
    while decoy_value is None or decoy_value == value:
        decoy_value = random_key(rng, set())
    inserts = [Insert(depth, f"Let {chain[0]} = {value}.")]
    inserts += [Insert(p, f"Let {b} = {a}.") for p, a, b in zip(spread(rng, 4, depth), chain, chain[1:])]
    decoy_at = spread(rng, 3)
    inserts.append(Insert(decoy_at[0], f"Let {decoy[0]} = {decoy_value}."))
    inserts += [Insert(p, f"Let {b} = {a}.") for p, a, b in zip(decoy_at[1:], decoy, decoy[1:])]
    return Problem(intro=_VAR_INTRO,
                   question=f"Which variables are equal to {value}? Answer with their names only.",
                   inserts=tuple(inserts), expected=tuple(chain), kind=NAME, max_tokens=48)
