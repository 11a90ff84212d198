"""What a run leaves behind: results.jsonl (one line per trial), summary.json, the tables;
and the same tables again from results.jsonl files (`astream eval report`), for a run that
was stopped before its summary or for several runs over the same prompts.

Throughput is what the run saw, summed over cells: prefill tok/s is prompt tokens / seconds
from each cell's start until its last trial's first token; decode tok/s is tokens generated
after each trial's first / seconds from then until the cell's last trial ended. The files
hold no timing: cells read back from them have no throughput (None, shown as "-").
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from astream.eval.runner import CellResult, TrialResult
from astream.eval.scoring import accuracy

RESULTS_FILE = "results.jsonl"
SUMMARY_FILE = "summary.json"


@dataclass(slots=True)
class Throughput:
    prompt_tokens: int = 0
    decode_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def prefill_tok_s(self) -> float | None:
        """None where nothing was timed (cells read back from results.jsonl)."""
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else None

    @property
    def decode_tok_s(self) -> float | None:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else None


def throughput(cells: Iterable[CellResult]) -> Throughput:
    """Summed over the cells that were timed (a cell read back from a file was not)."""
    total = Throughput()
    for cell in cells:
        if cell.prefill_s <= 0 and cell.decode_s <= 0:
            continue
        total.prompt_tokens += cell.prompt_tokens
        total.decode_tokens += cell.decode_tokens
        total.prefill_s += cell.prefill_s
        total.decode_s += cell.decode_s
    return total


def trial_row(result: TrialResult) -> dict:
    trial = result.trial
    return {"config": result.config, "task": trial.task, "length": trial.length, "depth": trial.depth,
            "trial": trial.index, "seed": trial.seed, "prompt_tokens": trial.prompt_tokens,
            "prompt_sha1": trial.prompt_sha1, "needle_depth": round(trial.needle_depth, 4),
            "expected": list(trial.expected), "answer": result.answer, "found": list(result.found),
            "score": result.score, "correct": result.correct,
            "generated_tokens": result.generated_tokens, "finish_reason": result.finish_reason,
            "error": result.error, "policy": result.policy}


@dataclass(slots=True)
class ResultsFile:
    """DIR/results.jsonl, written cell by cell so an interrupted run keeps what it finished.
    The first cell replaces the file of an earlier run (a run that fails before it leaves
    none), unless the file is opened `started`: a resumed run appends to it."""

    path: Path
    started: bool = False

    def write_cell(self, cell: CellResult) -> None:
        if not self.started:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a" if self.started else "w") as file:
            self.started = True
            for result in cell.results:
                file.write(json.dumps(trial_row(result)) + "\n")


@dataclass(slots=True, frozen=True)
class RecordedTrial:
    """A trial as results.jsonl records it: its prompt by length and hash, not its tokens."""

    task: str
    length: int
    depth: float
    index: int
    seed: int
    prompt_tokens: int
    prompt_sha1: str
    expected: tuple[str, ...]
    needle_depth: float


def load_results(paths: Iterable[Path], *, one_policy: bool = True) -> list[CellResult]:
    """The cells of results.jsonl files (each path a run's folder or the file itself), in the
    order their rows first appear. A trial that a later row repeats (same configuration,
    cell, trial number and prompt) takes the later row. ValueError names a missing file, a
    line that is not a trial row, or (with `one_policy`) a configuration whose rows ran
    different sparse policies (rows that do not record theirs count as one more)."""
    trials: dict[tuple, TrialResult] = {}
    for path in paths:
        file = path / RESULTS_FILE if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"{path}: no {RESULTS_FILE} there")
        for number, line in enumerate(file.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                result = _trial_result(json.loads(line))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{file}:{number}: not a trial row ({exc})") from None
            trial = result.trial
            trials[(result.config, trial.task, trial.length, trial.depth, trial.index,
                    trial.prompt_sha1)] = result
    if one_policy:
        _check_one_policy_each(trials.values())
    cells: dict[tuple, CellResult] = {}
    for result in trials.values():
        trial = result.trial
        key = (result.config, trial.task, trial.length, trial.depth)
        cells.setdefault(key, CellResult(*key)).results.append(result)
    return list(cells.values())


def _check_one_policy_each(results: Iterable[TrialResult]) -> None:
    """ValueError naming a configuration whose rows ran different sparse policies."""
    policies: dict[str, set] = {}
    for result in results:
        policies.setdefault(result.config, set()).add(result.policy)
    for config, seen in policies.items():
        if len(seen) > 1:
            named = "; ".join(sorted(p or "not recorded" for p in seen))
            raise ValueError(f"configuration {config!r} has rows of different sparse policies "
                             f"({named}): give them different names (the rows' \"config\")")


def _trial_result(row: dict) -> TrialResult:
    trial = RecordedTrial(str(row["task"]), int(row["length"]), float(row["depth"]), int(row["trial"]),
                          int(row["seed"]), int(row["prompt_tokens"]), str(row["prompt_sha1"]),
                          tuple(row["expected"]), float(row["needle_depth"]))
    return TrialResult(str(row["config"]), trial, row["answer"], tuple(row["found"]),
                       float(row["score"]), bool(row["correct"]), int(row["generated_tokens"]),
                       row["finish_reason"], row["error"], policy=row.get("policy"))


def write_summary(cells: Sequence[CellResult], out_dir: Path) -> Path:
    """out_dir/summary.json of the cells (`summary`)."""
    path = out_dir / SUMMARY_FILE
    path.write_text(json.dumps(summary(cells), indent=2) + "\n")
    return path


def summary(cells: Sequence[CellResult]) -> dict:
    """Accuracy and throughput per configuration and per cell (summary.json). Accuracy is a
    fraction in [0, 1]; a cell's prompt tokens are given per trial (the mean) and in total."""
    out: dict = {}
    configs = _unique(c.config for c in cells)
    for config in configs:
        mine = [c for c in cells if c.config == config]
        speed = throughput(mine)
        out[config] = {
            "accuracy": _accuracy(mine), "prefill_tok_s": _rounded(speed.prefill_tok_s),
            "decode_tok_s": _rounded(speed.decode_tok_s),
            "cells": [{"task": c.task, "length": c.length, "depth": c.depth, "trials": len(c.results),
                       "accuracy": c.accuracy,
                       "prompt_tokens_per_trial": round(c.prompt_tokens / max(len(c.results), 1), 1),
                       "prompt_tokens_total": c.prompt_tokens,
                       "prefill_tok_s": _rounded(throughput([c]).prefill_tok_s),
                       "decode_tok_s": _rounded(throughput([c]).decode_tok_s), **c.policy}
                      for c in mine]}
        found = paired_difference(cells, config, configs[0]) if config != configs[0] else None
        if found is not None:
            out[config]["against_first"] = {"config": configs[0], **found.as_points()}
    return out


@dataclass(slots=True, frozen=True)
class PairedDifference:
    """A configuration's mean score less the reference's over the trials both ran on the
    same prompt, and the standard error of that mean (from the per-prompt differences: the
    prompts' own difficulty cancels, so it is much smaller than the two accuracies' own)."""

    mean: float
    standard_error: float
    pairs: int

    def as_points(self) -> dict:
        return {"points": round(100 * self.mean, 2),
                "standard_error_points": round(100 * self.standard_error, 2), "pairs": self.pairs}


def paired_difference(cells: Sequence[CellResult], config: str,
                      reference: str) -> PairedDifference | None:
    """`config` against `reference` over the trials of the same prompts; None under 2 pairs."""
    def scores(name: str) -> dict:
        return {(r.trial.task, r.trial.length, r.trial.depth, r.trial.index, r.trial.prompt_sha1):
                r.score for c in cells if c.config == name for r in c.results}
    ours, theirs = scores(config), scores(reference)
    diffs = [ours[key] - theirs[key] for key in ours.keys() & theirs.keys()]
    if len(diffs) < 2:
        return None
    mean = sum(diffs) / len(diffs)
    variance = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return PairedDifference(mean, math.sqrt(variance / len(diffs)), len(diffs))


def format_summary(cells: Sequence[CellResult]) -> str:
    """Per configuration and task: accuracy by length and depth; then, with several
    configurations, one table of accuracy by task and length for all of them."""
    parts = [_config_tables(config, [c for c in cells if c.config == config])
             for config in _unique(c.config for c in cells)]
    if len(parts) > 1:
        parts.append(_compare_table(cells))
    errors = sum(r.error is not None for c in cells for r in c.results)
    if errors:
        parts.append(f"{errors} trial(s) ended with an error: see the 'error' field of results.jsonl")
    return "\n\n".join(parts)


def _config_tables(config: str, cells: list[CellResult]) -> str:
    speed = throughput(cells)
    lines = [f"[{config}] accuracy {_pct(_accuracy(cells))} of {sum(len(c.results) for c in cells)} "
             f"trials; prefill {_rate(speed.prefill_tok_s)} tok/s, decode {_rate(speed.decode_tok_s)} tok/s"]
    for task in _unique(c.task for c in cells):
        mine = [c for c in cells if c.task == task]
        depths = _unique(c.depth for c in mine)
        rows = [[str(length)] + [_pct(_accuracy(_select(mine, length=length, depth=d))) for d in depths]
                + [_pct(_accuracy(_select(mine, length=length)))]
                for length in _unique(c.length for c in mine)]
        lines.append(_table([f"{task} length"] + [f"d={d:g}" for d in depths] + ["all"], rows))
    return "\n\n".join(lines)


def _compare_table(cells: Sequence[CellResult]) -> str:
    configs = _unique(c.config for c in cells)
    rows = [[task, str(length)] + [_pct_of(_select(cells, config=k, task=task, length=length))
                                   for k in configs]
            for task in _unique(c.task for c in cells) for length in _unique(c.length for c in cells)
            if _select(cells, task=task, length=length)]
    rows.append(["all", ""] + [_pct(_accuracy(_select(cells, config=k))) for k in configs])
    differences = [paired_difference(cells, k, configs[0]) for k in configs[1:]]
    rows.append([f"vs {configs[0]}", "points", ""] + [
        "" if d is None else f"{100 * d.mean:+.1f} ± {100 * d.standard_error:.1f}" for d in differences])
    speeds = [throughput(_select(cells, config=k)) for k in configs]
    rows.append(["prefill", "tok/s"] + [_rate(s.prefill_tok_s) for s in speeds])
    rows.append(["decode", "tok/s"] + [_rate(s.decode_tok_s) for s in speeds])
    return ("accuracy by configuration (same prompts; against the first: the mean difference "
            "± its standard error over the prompts)\n" + _table(["task", "length", *configs], rows))


def _select(cells: Iterable[CellResult], **match) -> list[CellResult]:
    return [c for c in cells if all(getattr(c, k) == v for k, v in match.items())]


def _accuracy(cells: Sequence[CellResult]) -> float:
    return accuracy(r.score for c in cells for r in c.results)


def _rounded(rate: float | None) -> float | None:
    return None if rate is None else round(rate, 1)


def _rate(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:,.0f}"


def _pct_of(cells: Sequence[CellResult]) -> str:
    """Accuracy of the cells, "-" where they hold no trial (a configuration not run there)."""
    return _pct(_accuracy(cells)) if any(c.results for c in cells) else "-"


def _pct(value: float) -> str:
    return f"{100 * value:.0f}%"


def _unique(values: Iterable) -> list:
    return list(dict.fromkeys(values))


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in [header, *rows])
