"""The benchmark harness: one entry point, shared options, one result schema.

    python benchmarks/run.py NAME [--device cuda|cpu] [--repeats N] [--out FILE] [--smoke] [...]

NAME is a module of benchmarks/ that exposes:

- `cases(options)`: an iterable of (params, run) pairs, built lazily: a generator may hold
  an engine open across the cases it yields, and the harness runs each case before asking
  for the next. `params` is a dict naming the case; `run()` measures it once and returns a
  dict of figures;
- optionally `add_arguments(parser)` for its own options (read back from `options`), and
  `summarize(result)` to print derived figures after the last row.

The harness calls each case's `run()` `--repeats` times, prints min / median / max of each
figure, and rewrites the result file after every row (a run cut short keeps its rows).
What `run()` returns:

- a number, or a list of numbers (the samples of one run: say, the times of 10 decode steps),
  is a measured figure; the samples of every repeat are pooled for min / median / max;
- anything else (str, bool, None), and the values under an "info" key, are kept as they are
  from the last repeat; "ok": False in any repeat marks the row failed, and the harness then
  exits 1 (after writing the file).

Shared options: --device (default cuda when there is one, else cpu), --repeats (default 1),
--out (default benchmarks/results/<stem>.json, where the stem is NAME, or NAME_SECTION for a
benchmark with a --section option; a copy goes to $OUT/ when $OUT is set, as on the device
machine), --smoke (tiny shapes on the CPU: it checks the benchmark, not the speed; written
under /tmp/astream-smoke/ unless --out is given).

Result file (JSON):

    {"benchmark": NAME, "commit": git HEAD ("-dirty" when tracked files differ),
     "device": the GPU's name or "cpu", "torch": version, "date": "YYYY-mm-dd HH:MM:SS",
     "options": every option of the run, shared and the benchmark's own,
     "seconds": wall time so far,
     "rows": [{"params": {...},
               "figures": {NAME: {"min": x, "median": x, "max": x,
                                  "values": [[samples of repeat 1], [of repeat 2], ...]}},
               "info": {...}}]}

The median is statistics.median (the mean of the two middle samples of an even count).
"""

from __future__ import annotations

import argparse
import importlib
import json
import numbers
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
ROOT = BENCHMARKS.parent
for path in (str(BENCHMARKS), str(ROOT)):
    if path not in sys.path:
        sys.path.insert(0, path)


def is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def split_result(result: dict) -> tuple[dict[str, list[float]], dict]:
    """A run's return value as (figures: name -> samples, info)."""
    figures, info = {}, dict(result.get("info", {}))
    for key, value in result.items():
        if key == "info":
            continue
        if is_number(value):
            figures[key] = [value]
        elif isinstance(value, (list, tuple)) and value and all(is_number(v) for v in value):
            figures[key] = list(value)
        else:
            info[key] = value
    return figures, info


def spread(samples: list[float]) -> dict:
    return {"min": min(samples), "median": statistics.median(samples), "max": max(samples)}


def run_case(run, repeats: int) -> dict:
    """`repeats` calls of `run`: one row's figures (min / median / max and the values) and info."""
    values: dict[str, list[list[float]]] = {}
    info: dict = {}
    ok = True
    for _ in range(repeats):
        figures, info = split_result(run())
        ok = ok and info.get("ok", True) is not False
        for key, samples in figures.items():
            values.setdefault(key, []).append(samples)
    if "ok" in info:
        info["ok"] = ok
    figures = {key: {**spread([v for repeat in runs for v in repeat]), "values": runs}
               for key, runs in values.items()}
    return {"figures": figures, "info": info}


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device: str) -> str:
    import torch
    return torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"


def fmt(x: float) -> str:
    return f"{x:.4g}" if abs(x) < 1e5 else f"{x:.0f}"


def print_row(index: int, params: dict, row: dict) -> None:
    print(f"[{index}] " + " ".join(f"{k}={v}" for k, v in params.items()), flush=True)
    for key, f in row["figures"].items():
        count = sum(len(r) for r in f["values"])
        print(f"    {key:<28}{fmt(f['min']):>12} / {fmt(f['median'])} / {fmt(f['max'])}"
              f"   ({count} values)", flush=True)
    shown = {k: v for k, v in row["info"].items() if not isinstance(v, (dict, list))}
    if shown:
        print("    " + "  ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}"
                                  for k, v in shown.items()), flush=True)


def out_paths(name: str, options) -> list[Path]:
    stem = name + (f"_{options.section}" if getattr(options, "section", None) else "")
    if options.out:
        path = Path(options.out)
    elif options.smoke:
        path = Path("/tmp/astream-smoke") / f"{stem}.json"
    else:
        path = BENCHMARKS / "results" / f"{stem}.json"
    paths = [path]
    if os.environ.get("OUT") and not options.smoke:
        copy = Path(os.environ["OUT"]) / path.name
        if copy.resolve() != path.resolve():
            paths.append(copy)
    return paths


def write(result: dict, paths: list[Path]) -> None:
    text = json.dumps(result, indent=1, default=str)
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def run_benchmark(name: str, module, options) -> dict:
    """Every case of `module` run `options.repeats` times; the result, also written to file."""
    import torch
    start = time.perf_counter()
    paths = out_paths(name, options)
    result = {"benchmark": name, "commit": git_commit(), "device": device_name(options.device),
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "options": vars(options), "seconds": 0.0, "rows": []}
    cases = iter(module.cases(options))
    try:
        while True:
            try:
                params, run = next(cases)
            except StopIteration:
                break
            row = {"params": params, **run_case(run, options.repeats)}
            del run                     # let the case's engine go before the next one starts
            result["rows"].append(row)
            result["seconds"] = round(time.perf_counter() - start, 2)
            write(result, paths)
            print_row(len(result["rows"]), params, row)
    finally:
        close = getattr(cases, "close", None)
        if close is not None:
            close()
    result["seconds"] = round(time.perf_counter() - start, 2)
    write(result, paths)
    if hasattr(module, "summarize"):
        module.summarize(result)
    print(f"wrote {', '.join(map(str, paths))} ({len(result['rows'])} rows, "
          f"{result['seconds']:.0f} s)")
    return result


def parse(argv: list[str] | None) -> tuple[str, object, argparse.Namespace]:
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("name", nargs="?")
    known, _ = first.parse_known_args(argv)
    parser = argparse.ArgumentParser(prog="benchmarks/run.py", description=__doc__.splitlines()[0])
    parser.add_argument("name", help="a benchmark module of benchmarks/, e.g. quest")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each case")
    parser.add_argument("--out", default=None, help="the result file (JSON)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    module = None
    if known.name and not known.name.startswith("-"):
        module = importlib.import_module(known.name)
        if not hasattr(module, "cases"):
            parser.error(f"{known.name} is not a harness benchmark: run it as "
                         f"python benchmarks/{known.name}.py")
        if hasattr(module, "add_arguments"):
            module.add_arguments(parser)
        parser.description = (module.__doc__ or "").strip().splitlines()[0] if module.__doc__ else None
    options = parser.parse_args(argv)
    if options.device is None:
        import torch
        options.device = "cuda" if torch.cuda.is_available() and not options.smoke else "cpu"
    return options.name, module, options


def main(argv: list[str] | None = None) -> int:
    name, module, options = parse(argv)
    result = run_benchmark(name, module, options)
    failed = [row["params"] for row in result["rows"] if row["info"].get("ok") is False]
    for params in failed:
        print(f"FAILED: {params}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
