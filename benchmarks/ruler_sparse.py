"""RULER-style accuracy of the sparse prefill policies at settings denser than their defaults,
on the same prompts as `astream eval ruler` (same seed, lengths, depths and trials), so the
rows compare with that command's full / xattention / minference rows.

    python benchmarks/ruler_sparse.py --model qwen25coder05b.gguf [--full] [--thresholds 0.95,0.99]
        [--minference-factors 2,4] [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import anyio

from common import RESULTS  # noqa: I001  (sets sys.path)
from astream.eval.evaluation import EvalPlan, run_eval
from astream.eval.report import format_summary
from astream.eval.tasks import RULER_TASKS
from astream.eval.spec import EvalConfig, parse_depths, parse_lengths
from astream.policies import MInferencePolicy, XAttentionPolicy


def configs(thresholds: list[float], size_factors: list[int]) -> list[EvalConfig]:
    out = [EvalConfig(f"xattention tau={t}", {"sparse_policy": XAttentionPolicy(threshold=t)})
           for t in thresholds]
    base = MInferencePolicy()
    out += [EvalConfig(f"minference x{f}", {"sparse_policy": MInferencePolicy(
        vertical_size=base.vertical_size * f, slash_size=base.slash_size * f)}) for f in size_factors]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--lengths", default="8192,16384,32000")
    parser.add_argument("--depths", default="0.25,0.75")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--thresholds", default="0.95,0.99")
    parser.add_argument("--minference-factors", default="2,4")
    parser.add_argument("--full", action="store_true", help="run Full first, on the same prompts")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=RESULTS / "eval" / "ruler_sparse")
    args = parser.parse_args()
    plan = EvalPlan(tuple(RULER_TASKS), tuple(parse_lengths(args.lengths)), tuple(parse_depths(args.depths)),
                    args.trials)
    chosen = [EvalConfig("full", {})] if args.full else []
    chosen += configs([float(t) for t in args.thresholds.split(",") if t],
                     [int(f) for f in args.minference_factors.split(",") if f])
    run = anyio.run(lambda: run_eval(plan, args.model, chosen, {"device": args.device}, args.out))
    print(format_summary(run.cells))


if __name__ == "__main__":
    main()
