"""Running trials through engines: each cell's trials at once, one configuration at a time."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import anyio

from astream.base.config import EngineConfig
from astream.base.sampling import SamplingParams
from astream.engine.engine import Engine
from astream.eval.scoring import accuracy, score
from astream.eval.spec import EvalConfig
from astream.eval.trials import Trial, group_cells
from astream.policies import make_policy


@dataclass(slots=True)
class TrialResult:
    config: str
    trial: Trial                            # or a report.RecordedTrial, read back from a file
    answer: str = ""
    found: tuple[str, ...] = ()
    score: float = 0.0
    correct: bool = False
    generated_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    first_token_at: float | None = None     # perf_counter() when its first token arrived
    policy: str | None = None               # resolved_policy of its engine (None: not recorded)


@dataclass(slots=True)
class CellResult:
    """A cell's trials and timing. The phases overlap a little under continuous batching:
    prefill runs from the cell's start until the last trial's first token, decode from then
    until the last trial ends."""

    config: str
    task: str
    length: int
    depth: float
    results: list[TrialResult] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    policy: dict = field(default_factory=dict)    # what the sparse policy did during the cell

    @property
    def accuracy(self) -> float:
        return accuracy(r.score for r in self.results)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.trial.prompt_tokens for r in self.results)

    @property
    def decode_tokens(self) -> int:
        """Generated tokens after each trial's first (that one ends its prefill)."""
        return sum(max(0, r.generated_tokens - 1) for r in self.results)


TrialHook = Callable[[TrialResult], None]
CellHook = Callable[[CellResult], None]


def resolved_policy(config: EngineConfig) -> str:
    """The sparse policy an engine of `config` runs, every parameter spelled out (its repr).
    A results row records it, so rows under one configuration name that ran different
    policies (another default, another version) are told apart."""
    return repr(make_policy(config.sparse_policy, config.sparse_budget))


def check_configs(model: str | None, configs: Sequence[EvalConfig], engine_kwargs: dict) -> dict[str, str]:
    """Every configuration's engine options are valid: fail before any model loads. Returns
    each configuration's `resolved_policy` (no engine is built)."""
    policies = {}
    for config in configs:
        try:
            options = Engine.check_options(model, **{**engine_kwargs, **config.engine_kwargs})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"configuration {config.name!r}: {exc}") from None
        policies[config.name] = resolved_policy(options)
    return policies


async def run_configs(model: str | None, trials: Sequence[Trial], configs: Sequence[EvalConfig],
                      engine_kwargs: dict, on_trial: TrialHook | None = None,
                      on_cell: CellHook | None = None,
                      pending: Mapping[str, Sequence[Trial]] | None = None) -> list[CellResult]:
    """The same trials under each configuration, one engine at a time (closed before the next
    opens, so only one holds memory). Unset `max_model_len` and `max_num_seqs` become what the
    trials need (the longest prompt and answer; the largest cell), which also keeps an
    offload engine's host pool no larger than they use. `pending` gives a configuration
    only some of the trials to run (a resumed run); the engine is sized for all of them all
    the same, so a cell runs alike whichever run it falls in, and a configuration with
    nothing left opens no engine."""
    check_configs(model, configs, engine_kwargs)
    defaults = {"max_model_len": max(len(t.prompt_ids) + t.max_tokens for t in trials),
                "max_num_seqs": max(len(cell) for cell in group_cells(trials))}
    _check_length(defaults["max_model_len"], engine_kwargs.get("max_model_len"))
    cells: list[CellResult] = []
    for config in configs:
        mine = trials if pending is None else pending.get(config.name, trials)
        if not mine:
            continue
        kwargs = {**defaults, **engine_kwargs, **config.engine_kwargs}
        async with Engine(model, **kwargs) as engine:
            cells += await evaluate(engine, mine, config.name, on_trial, on_cell)
    return cells


async def evaluate(engine: Engine, trials: Sequence[Trial], config: str = "default",
                   on_trial: TrialHook | None = None, on_cell: CellHook | None = None) -> list[CellResult]:
    """Every cell of `trials` on an open engine, cell after cell."""
    _check_fits(engine, trials)
    cells = []
    for cell_trials in group_cells(trials):
        cells.append(await run_cell(engine, cell_trials, config, on_trial))
        if on_cell is not None:
            on_cell(cells[-1])
    return cells


async def run_cell(engine: Engine, trials: Sequence[Trial], config: str = "default",
                   on_trial: TrialHook | None = None) -> CellResult:
    """The trials of one cell, submitted together so the engine batches them."""
    task, length, depth = trials[0].cell
    policy = resolved_policy(engine.config)
    cell = CellResult(config, task, length, depth,
                      [TrialResult(config, t, policy=policy) for t in trials])
    failures: list[BaseException] = []
    before = engine.stats()
    start = time.perf_counter()

    async def one(result: TrialResult) -> None:
        try:
            await _generate(engine, result)
        except Exception as exc:          # re-raised below as itself, not in an exception group
            failures.append(exc)
            raise
        if on_trial is not None:
            on_trial(result)

    try:
        async with anyio.create_task_group() as group:
            for result in cell.results:
                group.start_soon(one, result)
    except BaseException:
        if failures:
            raise failures[0] from None
        raise
    end = time.perf_counter()
    last_first = max((r.first_token_at for r in cell.results if r.first_token_at), default=end)
    cell.prefill_s, cell.decode_s = last_first - start, end - last_first
    cell.policy = policy_activity(before, engine.stats())
    return cell


def policy_activity(before: dict, after: dict) -> dict:
    """What the sparse policy did between two engine.stats(): the share of what prefill could
    see that XAttention, MInference or FlexPrefill read, and the pages a Quest selection read
    on average."""
    out = {}
    for method, totals in (("xattention", "xattention_blocks"), ("minference", "minference_keys"),
                            ("flexprefill", "flexprefill_blocks")):
        if totals in after:
            read, visible = (a - b for a, b in zip(after[totals], before[totals]))
            out[f"{method}_density"] = round(read / visible, 4) if visible else None
    if "quest_pages_read" in after:
        pages = sum(after["quest_pages_read"]) - sum(before["quest_pages_read"])
        rows = sum(after["quest_selections"]) - sum(before["quest_selections"])
        out["quest_pages_per_selection"] = round(pages / rows, 1) if rows else None
    return out


async def _generate(engine: Engine, result: TrialResult) -> None:
    trial = result.trial
    params = SamplingParams(temperature=0.0, max_tokens=trial.max_tokens)
    async for token in engine.stream(list(trial.prompt_ids), params):
        if result.first_token_at is None:
            result.first_token_at = time.perf_counter()
        if token.token_id >= 0:           # the abort marker carries no token
            result.generated_tokens += 1
        result.answer += token.text
        result.finish_reason, result.error = token.finish_reason, token.error
    verdict = score(result.answer, trial.expected, trial.kind)
    result.found, result.score, result.correct = verdict.found, verdict.score, verdict.correct


def _check_fits(engine: Engine, trials: Sequence[Trial]) -> None:
    _check_length(max(len(t.prompt_ids) + t.max_tokens for t in trials), engine.stats()["max_model_len"])


def _check_length(needed: int, limit: int | None) -> None:
    if limit is not None and needed > limit:
        raise ValueError(f"the longest trial needs {needed} tokens (prompt and answer) but max_model_len "
                         f"is {limit}; raise max_model_len or ask for shorter lengths")
