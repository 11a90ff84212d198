"""Trials: the grid of (task, length, depth, trial) and the one prompt each of them has.

A trial's problem and haystack come from a generator seeded by (seed, task, length, depth,
trial) alone, so any cell can be re-run by itself and get the same prompts.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Iterable

from astream.eval.haystack import build_prompt
from astream.eval.tasks import make_problem


@dataclass(slots=True, frozen=True)
class Trial:
    task: str
    length: int                  # the asked prompt length in tokens
    depth: float                 # the asked depth of the sentence the question is about
    index: int                   # trial number within its cell
    seed: int
    prompt_ids: tuple[int, ...]
    expected: tuple[str, ...]    # every item a correct answer states
    kind: str                    # "number" or "name": how the answer is scored
    max_tokens: int
    needle_depth: float          # where that sentence landed, as a share of the filler tokens

    @property
    def cell(self) -> tuple[str, int, float]:
        return self.task, self.length, self.depth

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def prompt_sha1(self) -> str:
        return hashlib.sha1(" ".join(map(str, self.prompt_ids)).encode()).hexdigest()


def trial_rng(seed: int, task: str, length: int, depth: float, index: int) -> random.Random:
    # A string seed goes through SHA-512: stable across runs, processes and PYTHONHASHSEED.
    return random.Random(f"astream-eval/{seed}/{task}/{length}/{float(depth)!r}/{index}")


def build_trial(tokenizer, task: str, length: int, depth: float, index: int, seed: int = 0) -> Trial:
    """Trial `index` of cell (task, length, depth): the same arguments give the same prompt."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if length < 1:
        raise ValueError(f"length must be a positive number of tokens, got {length}")
    rng = trial_rng(seed, task, length, depth, index)
    problem = make_problem(task, rng, length, depth)
    prompt = build_prompt(tokenizer, problem, length, rng)
    return Trial(task, length, float(depth), index, seed, prompt.ids, problem.expected, problem.kind,
                 problem.max_tokens, prompt.needle_depth)


def build_trials(tokenizer, tasks: Iterable[str], lengths: Iterable[int], depths: Iterable[float],
                 trials: int, seed: int = 0) -> list[Trial]:
    """Every trial of the grid, cell by cell (task, then length, then depth)."""
    if trials < 1:
        raise ValueError(f"trials must be at least 1, got {trials}")
    return [build_trial(tokenizer, task, length, depth, index, seed)
            for task in tasks for length in lengths for depth in depths for index in range(trials)]


def group_cells(trials: Iterable[Trial]) -> list[list[Trial]]:
    """The trials grouped by cell, in the order the cells first appear."""
    cells: dict[tuple, list[Trial]] = {}
    for trial in trials:
        cells.setdefault(trial.cell, []).append(trial)
    return list(cells.values())
