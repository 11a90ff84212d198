"""The `astream eval` command: `astream eval needle ...`, `astream eval ruler ...`, and
`astream eval report DIR ...`, the tables again from runs' results.jsonl.

The main CLI registers it with `add_eval_command` and hands over its own way of adding one
flag per engine option, so every engine knob (--offload, --sparse-policy, ...) works here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

from astream.eval.evaluation import EvalPlan, run_eval
from astream.eval.report import format_summary, load_results, write_summary
from astream.eval.spec import parse_configs, parse_depths, parse_lengths, parse_names
from astream.eval.tasks import AGGREGATION_TASKS, NEEDLE, RULER_TASKS

AddEngineOptions = Callable[[argparse._ArgumentGroup], None]


def add_eval_command(commands: argparse._SubParsersAction, add_engine_options: AddEngineOptions) -> None:
    parser = commands.add_parser("eval", help="long-context accuracy: passkey needle, RULER-style tasks",
                                 description="Accuracy over a grid of prompt lengths and depths; "
                                 "writes results.jsonl, summary.json and PNG plots to --out.")
    tasks = parser.add_subparsers(dest="eval_task", required=True, metavar="TASK")
    needle = tasks.add_parser("needle", help="passkey retrieval over lengths x depths")
    ruler = tasks.add_parser("ruler", help=f"RULER-style synthetic tasks: {', '.join(RULER_TASKS)}; "
                             f"aggregation: {', '.join(AGGREGATION_TASKS)}")
    needle.set_defaults(eval_tasks=[NEEDLE])
    ruler.add_argument("--tasks", dest="eval_tasks", default=list(RULER_TASKS), metavar="LIST",
                       type=_checked(lambda text: parse_names(text, RULER_TASKS + AGGREGATION_TASKS, "tasks")),
                       help=f"comma-separated (default: {','.join(RULER_TASKS)}); the aggregation tasks "
                       f"{','.join(AGGREGATION_TASKS)} (10 most common words of a list, 3 most frequent "
                       "coded words of a Zipf text) run only when named, and ignore the depth but for "
                       "the seed")
    for sub in (needle, ruler):
        sub.set_defaults(run=run_eval_command)
        _add_grid_options(sub)
        add_engine_options(sub.add_argument_group("engine options (for every configuration)"))
    report = tasks.add_parser(
        "report", help="the tables again from results.jsonl (a stopped run, or several runs)",
        description="Reads the results.jsonl of one or more runs (folders or files) and prints "
        "their tables, with every configuration against the first over the prompts both ran. "
        "A trial that a later file repeats takes the later row. The files hold no timing, so "
        "there is no throughput.")
    report.add_argument("runs", nargs="+", type=Path, metavar="RUN",
                        help="a run's --out folder, or its results.jsonl")
    report.add_argument("--out", type=Path, metavar="DIR",
                        help="also write summary.json of them all to DIR")
    report.set_defaults(run=run_report_command, engine_free=True)


def _add_grid_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="PATH", help="HF folder or .gguf file "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--lengths", type=_checked(parse_lengths), default=parse_lengths("4K,8K,16K,32K"),
                        metavar="LIST", help="prompt lengths in tokens, K = 1024 (default: 4K,8K,16K,32K)")
    parser.add_argument("--depths", type=_checked(parse_depths), metavar="LIST",
                        default=parse_depths("0.1,0.3,0.5,0.7,0.9"),
                        help="where the needle sits, 0 (start) to 1 (end) (default: 0.1,0.3,0.5,0.7,0.9)")
    parser.add_argument("--trials", type=_checked(_positive), default=3, metavar="N",
                        help="prompts per cell, each with its own key (default: 3)")
    parser.add_argument("--seed", type=int, default=0, metavar="N",
                        help="the same seed gives the same prompts (default: 0)")
    parser.add_argument("--compare", type=_checked(parse_configs), metavar="SPEC",
                        help="run configurations one after another on the same prompts, e.g. "
                        "'full,quest:1024,quest:2048+offload'; each item sets the sparse policy "
                        "(':N' its budget) and offload")
    parser.add_argument("--out", type=Path, default=Path("astream-eval"), metavar="DIR",
                        help="folder for results.jsonl, summary.json and the plots (default: astream-eval)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the cells DIR/results.jsonl already holds for these prompts and "
                        "configurations, run only the rest and append them (a run stopped midway "
                        "goes on where it stopped)")


async def run_eval_command(args: argparse.Namespace, engine_kwargs: dict, _sampling=None) -> None:
    if args.compare and {"offload", "sparse_policy"} & engine_kwargs.keys():
        raise ValueError("--compare sets the sparse policy and offload of each configuration; "
                         "drop --offload / --sparse-policy, or write them into the --compare items")
    plan = EvalPlan(tuple(args.eval_tasks), tuple(args.lengths), tuple(args.depths), args.trials, args.seed)
    run = await run_eval(plan, args.model, args.compare, engine_kwargs, args.out, progress=True,
                         resume=args.resume)
    print(format_summary(run.cells))
    for note in run.notes:
        print(f"astream: {note}", file=sys.stderr)
    print(f"astream: wrote {', '.join(str(path) for path in run.files)}", file=sys.stderr)


async def run_report_command(args: argparse.Namespace) -> None:
    cells = load_results(args.runs)
    if not cells:
        raise ValueError(f"no trials in {', '.join(map(str, args.runs))}")
    print(format_summary(cells))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        print(f"astream: wrote {write_summary(cells, args.out)}", file=sys.stderr)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be at least 1, got {value}")
    return value


def _checked(parse: Callable[[str], object]) -> Callable[[str], object]:
    """argparse shows an ArgumentTypeError's own message (a ValueError becomes 'invalid value')."""
    def convert(text: str) -> object:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return convert
