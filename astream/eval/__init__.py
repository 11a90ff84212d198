"""Long-context evaluation: passkey retrieval and RULER-style tasks over lengths x depths,
so a sparse policy's accuracy is measured next to the time it saves.

    astream eval needle --lengths 4K,8K --depths 0.1,0.5,0.9 --trials 3 --out DIR
    astream eval ruler --tasks multikey,vartrack --compare full,quest:1024,quest:2048+offload --out DIR
    astream eval ruler --tasks cwe,fwe --depths 0.5 --trials 6 --compare full,quest:512 --out DIR

Each trial's prompt is one chat turn built to the asked token length from seeded filler,
with its sentences at the asked depth (the aggregation tasks, cwe and fwe, have no needle:
their haystack is the list or text they count over); trial t of cell (task, length, depth)
depends only on (seed, task, length, depth, t). Answers are greedy and scored by whole-number (or whole-word)
match (scoring.py). DIR gets results.jsonl (one line per trial), summary.json (accuracy and
tokens per second per cell and configuration), heatmap PNGs and, with several
configurations, compare.png; the PNGs need matplotlib (`pip install "astream[eval]"`).

From Python: `run_eval(EvalPlan(...), model, configs, engine_kwargs, out_dir)` does it all;
`build_trials` (the prompts) and `evaluate(engine, trials)` (on an open Engine) are its parts;
`load_results(paths)` reads runs' results.jsonl back into cells for `summary` and
`format_summary`.
"""

from astream.eval.evaluation import EvalPlan, EvalRun, config_from_options, run_eval, write_outputs
from astream.eval.report import format_summary, load_results, summary, throughput, trial_row
from astream.eval.runner import CellResult, TrialResult, check_configs, evaluate, run_cell, run_configs
from astream.eval.scoring import Verdict, extract, score
from astream.eval.spec import EvalConfig, parse_configs, parse_depths, parse_lengths
from astream.eval.tasks import AGGREGATION_TASKS, NEEDLE, RULER_TASKS, TASKS
from astream.eval.tokenizer import load_tokenizer
from astream.eval.trials import Trial, build_trial, build_trials, group_cells

__all__ = ["AGGREGATION_TASKS", "CellResult", "EvalConfig", "EvalPlan", "EvalRun", "NEEDLE", "RULER_TASKS", "TASKS", "Trial",
           "TrialResult", "Verdict", "build_trial", "build_trials", "check_configs", "config_from_options",
           "evaluate", "extract", "format_summary", "group_cells", "load_results", "load_tokenizer", "parse_configs",
           "parse_depths", "parse_lengths", "run_cell", "run_configs", "run_eval", "score", "summary",
           "throughput", "trial_row", "write_outputs"]
