"""The tasks by name: the passkey needle, the RULER-style set and its aggregation tasks."""

from __future__ import annotations

import random
from types import MappingProxyType
from typing import Callable

from astream.eval import aggregation, ruler
from astream.eval.problem import NUMBER, Insert, Problem, random_key

NEEDLE = "needle"
RULER_TASKS = ("distractor", "multikey", "multivalue", "vartrack")
# Opt-in, so a default `astream eval ruler` stays comparable with earlier figures.
AGGREGATION_TASKS = ("cwe", "fwe")

ProblemMaker = Callable[[random.Random, int, float], Problem]


def needle(rng: random.Random, length: int, depth: float) -> Problem:
    """Passkey retrieval: one 5-to-7-digit key, stated once, at `depth`."""
    key = random_key(rng, set())
    return Problem(intro="A pass key is hidden somewhere in the text below. Find it and remember it.",
                   question="What is the pass key? Answer with the number only.",
                   inserts=(Insert(depth, f"The pass key is {key}. Remember it."),),
                   expected=(key,), kind=NUMBER, max_tokens=16)


TASKS: MappingProxyType[str, ProblemMaker] = MappingProxyType({
    NEEDLE: needle, "distractor": ruler.distractor, "multikey": ruler.multikey,
    "multivalue": ruler.multivalue, "vartrack": ruler.vartrack,
    "cwe": aggregation.cwe, "fwe": aggregation.fwe})


def make_problem(task: str, rng: random.Random, length: int, depth: float) -> Problem:
    return task_maker(task)(rng, length, depth)


def task_maker(task: str) -> ProblemMaker:
    try:
        return TASKS[task]
    except KeyError:
        raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(TASKS)}") from None
