"""One evaluation from start to end: prompts, engines, results.jsonl, summary.json, plots.

    plan = EvalPlan(tasks=("needle",), lengths=(4096, 8192), depths=(0.1, 0.5, 0.9), trials=3)
    run = anyio.run(run_eval, plan, "model.gguf", parse_configs("full,offload"), {"device": "cuda"},
                    Path("out"))
    print(format_summary(run.cells))
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from astream.eval.plot import (missing_matplotlib_message, plotting_available, write_compare_plot,
                               write_heatmap)
from astream.eval.progress import ProgressBar
from astream.eval.report import RESULTS_FILE, ResultsFile, load_results, write_summary
from astream.eval.runner import CellResult, TrialResult, check_configs, run_configs
from astream.eval.spec import EvalConfig
from astream.eval.tokenizer import engine_tokenizer_option, load_tokenizer
from astream.eval.trials import Trial, build_trials


@dataclass(slots=True, frozen=True)
class EvalPlan:
    """The grid: every task at every length and depth, `trials` prompts per cell."""

    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    trials: int = 3
    seed: int = 0


@dataclass(slots=True)
class EvalRun:
    trials: list[Trial]
    cells: list[CellResult]
    files: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)     # e.g. why a plot is missing


def config_from_options(engine_kwargs: dict) -> EvalConfig:
    """The single configuration a run without --compare has, named like a --compare item."""
    name = str(engine_kwargs.get("sparse_policy", "full"))
    if engine_kwargs.get("sparse_budget") is not None:
        name += f":{engine_kwargs['sparse_budget']}"
    if engine_kwargs.get("offload"):
        name += "+offload"
    if engine_kwargs.get("kv_cache_dtype", "auto") != "auto":
        name += f"+{engine_kwargs['kv_cache_dtype']}"
    return EvalConfig(name, {})


async def run_eval(plan: EvalPlan, model: str | None = None, configs: Sequence[EvalConfig] | None = None,
                   engine_kwargs: dict | None = None, out_dir: Path | None = None, *,
                   tokenizer=None, progress: bool = False, resume: bool = False) -> EvalRun:
    """Build the plan's prompts once and run them under each configuration (default: one, from
    `engine_kwargs`). With `out_dir`, write results.jsonl, summary.json and the plots there.
    With `resume`, a cell that out_dir's results.jsonl already holds for a configuration (every
    trial of it, on the same prompts, under the same resolved sparse policy) is kept, not run
    again; new cells are appended to the file, and the summary covers both (throughput only
    the cells this run timed)."""
    engine_kwargs = dict(engine_kwargs or {})
    configs = list(configs) if configs else [config_from_options(engine_kwargs)]
    policies = check_configs(model, configs, engine_kwargs)
    if resume and out_dir is None:
        raise ValueError("resume needs the folder of the run to resume (--out)")
    if tokenizer is None:
        tokenizer = load_tokenizer(model, engine_kwargs.get("tokenizer"))
    trials = build_trials(tokenizer, plan.tasks, plan.lengths, plan.depths, plan.trials, plan.seed)
    path = out_dir / RESULTS_FILE if out_dir is not None else None
    earlier = resume and path.is_file()
    kept = finished_cells(path, trials, policies) if earlier else []
    done = {(c.config, c.task, c.length, c.depth) for c in kept}
    pending = {config.name: [t for t in trials if (config.name, *t.cell) not in done]
               for config in configs}
    results = ResultsFile(path, started=earlier) if path is not None else None
    bar = ProgressBar(sys.stderr, sum(map(len, pending.values()))) if progress else None

    def on_trial(result: TrialResult) -> None:
        bar.advance(result.correct, f"[{result.config}]")

    with engine_tokenizer_option(model, tokenizer, engine_kwargs) as kwargs:
        cells = await run_configs(model, trials, configs, kwargs, on_trial if bar is not None else None,
                                  results.write_cell if results is not None else None, pending)
    run = EvalRun(trials, _in_plan_order(kept + cells, trials, configs))
    if kept:
        run.notes.append(f"resumed: {len(kept)} cell(s) kept from {path}, {len(cells)} run now")
    if out_dir is not None:
        run.files.append(results.path)
        write_outputs(run, out_dir)
    return run


def finished_cells(path: Path, trials: Sequence[Trial], policies: dict[str, str]) -> list[CellResult]:
    """The cells of an earlier run's results.jsonl that hold every trial the plan has for
    them, on the same prompts, under one of the configurations `policies` names and the
    policy it resolves to (their rows restricted to the plan's)."""
    wanted: dict[tuple, set] = {}
    for trial in trials:
        wanted.setdefault(trial.cell, set()).add((trial.index, trial.prompt_sha1))
    finished = []
    for cell in load_results([path], one_policy=False):      # rows of other policies are dropped
        want = wanted.get((cell.task, cell.length, cell.depth))
        if cell.config not in policies or want is None:
            continue
        cell.results = [r for r in cell.results if (r.trial.index, r.trial.prompt_sha1) in want
                        and r.policy == policies[cell.config]]
        if {(r.trial.index, r.trial.prompt_sha1) for r in cell.results} == want:
            finished.append(cell)
    return finished


def _in_plan_order(cells: list[CellResult], trials: Sequence[Trial],
                   configs: Sequence[EvalConfig]) -> list[CellResult]:
    """Configuration by configuration, each in the plan's cell order."""
    order = {cell: i for i, cell in enumerate(dict.fromkeys(t.cell for t in trials))}
    rank = {config.name: i for i, config in enumerate(configs)}
    return sorted(cells, key=lambda c: (rank[c.config], order[(c.task, c.length, c.depth)]))


def write_outputs(run: EvalRun, out_dir: Path) -> None:
    """summary.json, and the plots when matplotlib is there (a note says how to get them if not)."""
    run.files.append(write_summary(run.cells, out_dir))
    if not plotting_available():
        run.notes.append(missing_matplotlib_message())
        return
    configs = list(dict.fromkeys(c.config for c in run.cells))
    for config in configs:
        name = "heatmap.png" if len(configs) == 1 else f"heatmap-{_slug(config)}.png"
        run.files.append(write_heatmap([c for c in run.cells if c.config == config], out_dir / name))
    if len(configs) > 1:
        run.files.append(write_compare_plot(run.cells, out_dir / "compare.png"))


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)
