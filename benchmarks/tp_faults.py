"""Tensor-parallel faults over NCCL (two GPUs), each scenario in a process of its own, its
stderr (every rank's) kept and searched:

- `clean_close`: TP=2 with decode graphs generates and closes; then a second engine starts in
  the same process. Passes where the close takes < 20 s and stderr holds no watchdog or
  "unhandled system error" trace and no Python traceback.
- `die_in_capture`: rank 1 is killed as rank 0 starts capturing the decode graphs. Passes
  where the start fails within 60 s (NCCL's own timeout: 300 s) with an error naming rank 1,
  and no child process is left.
- `die_in_decode`: rank 1 is killed while three streams decode from the graphs. Passes where
  every stream ends with an error naming rank 1 within 60 s, the engine stops, and no child
  is left.
- `capture_fails`: one GPU; capturing size 2 fails after the larger sizes were captured,
  and the error is held. Passes where the device memory reserved afterwards is back within
  1 MiB of where it was before the capture (the captured graphs and their pool are gone).
- `capture_fails_tp`: TP=2; rank 0's capture of size 2 fails. Passes where the start fails
  within 30 s with TensorParallelError, without the "did not tear down" warning, and no
  child is left.

    python benchmarks/run.py tensor_parallel --sections faults     # all of them, as rows
    python benchmarks/tp_faults.py SCENARIO                         # one, its JSON line last
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
for path in (str(BENCHMARKS), str(BENCHMARKS.parent)):
    if path not in sys.path:
        sys.path.insert(0, path)

SCENARIOS = ("clean_close", "die_in_capture", "die_in_decode", "capture_fails", "capture_fails_tp")
ALARMS = re.compile(r"unhandled system error|watchdog|Traceback|did not tear down"
                    r"|ProcessGroupNCCL.*(error|ERROR)")
SCENARIO_LIMIT_S = 240


def engine_options(tp: int, shape: str = "tiny", **extra) -> dict:
    from common import shaped_model, synthetic_tokenizer
    return {**dict(model=str(shaped_model(shape, max_positions=4096)), load_format="dummy",
                   tokenizer=synthetic_tokenizer(), device="cuda", dtype="bfloat16", max_num_seqs=8,
                   max_model_len=4096, tensor_parallel_size=tp, show_progress=False,
                   cuda_graph_max_batch=8), **extra}


def prompts(n: int) -> list[list[int]]:
    return [[100 + 7 * i + j for j in range(64 + 32 * i)] for i in range(n)]


def children() -> list[int]:
    return [p.pid for p in multiprocessing.active_children()]


def wait_children_gone(timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while children() and time.monotonic() < deadline:
        time.sleep(0.1)
    return children()


# ---------------------------------------------------------------- scenarios (in the child)

def clean_close() -> dict:
    from astream import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(**engine_options(2))
    outs = llm.generate(prompts(3), params)
    steps = llm.stats()["graph_steps"]
    start = time.monotonic()
    llm.close()
    close_s = time.monotonic() - start
    with LLM(**engine_options(2)) as again:               # the process left the group
        again_ok = bool(again.generate(prompts(1), params)[0].token_ids)
    return {"ok": close_s < 20 and again_ok and steps > 0 and all(o.token_ids for o in outs),
            "close_s": round(close_s, 2), "graph_steps": steps, "second_engine": again_ok,
            "children_left": wait_children_gone()}


def _expect_start_failure(patch, limit_s: float, pattern: str) -> dict:
    from astream import LLM
    patch()
    start = time.monotonic()
    error = None
    try:
        LLM(**engine_options(2)).close()
    except Exception as exc:                     # what the start raises is the result
        error = exc
    seconds = time.monotonic() - start
    left = wait_children_gone()
    text = "" if error is None else f"{type(error).__name__}: {error}"
    return {"ok": error is not None and re.search(pattern, text) is not None and seconds < limit_s
            and not left, "seconds": round(seconds, 2), "error": text[:300], "children_left": left}


def die_in_capture() -> dict:
    from astream.parallel import workers
    capture = workers.capture_graphs

    def patch():
        def killing(spec, runner):
            os.kill(runner.followers.pids[0], signal.SIGKILL)
            return capture(spec, runner)
        workers.capture_graphs = killing

    return _expect_start_failure(patch, 60, r"TensorParallelError: tensor-parallel rank 1 died")


def _fail_size_2() -> None:
    """Rank 0's capture of size 2 fails inside the capture, after the larger sizes."""
    import torch

    from astream.executor import cuda_graphs
    capture = cuda_graphs.capture_sampling_graphs

    def failing(sizes, run, *args):
        def run_or_fail(size):
            if size == 2 and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("capture of size 2 failed (injected)")
            return run(size)
        return capture(sizes, run_or_fail, *args)

    cuda_graphs.capture_sampling_graphs = failing


def capture_fails_tp() -> dict:
    return _expect_start_failure(_fail_size_2, 30, r"TensorParallelError: a tensor-parallel "
                                 r"decode graphs' capture failed on rank 0")


def capture_fails() -> dict:
    import torch

    from astream import LLM
    from astream.executor.build import capture_graphs, graph_spec
    _fail_size_2()
    with LLM(**engine_options(1, "qwen3-0.6b", enforce_eager=True, max_num_seqs=64,
                              cuda_graph_max_batch=64)) as llm:
        core = llm.core
        spec = graph_spec(core.config, core.plan, core.runner)
        gc.collect()
        torch.cuda.synchronize()
        # torch keeps a cuBLAS workspace per (handle, stream) from the caching allocator, one
        # for a capture's stream too, failed or not: a cache, not the graphs' memory. Both
        # counts below leave them out.
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        held = None
        try:
            capture_graphs(spec, core.runner)
        except RuntimeError as exc:
            held = exc                           # its traceback holds the capture's frames
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        held_mib = (torch.cuda.memory_reserved() - before) / 2**20
        failed = held is not None
        # The error's frames still hold the sampler's tables (plain tensors, not the graphs'
        # pool): they go with it.
        del held
        gc.collect()
        torch.cuda.empty_cache()
        after = torch.cuda.memory_reserved()
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        without_workspaces = torch.cuda.memory_reserved()
    return {"ok": failed and without_workspaces - before <= 1 << 20, "capture_failed": failed,
            "reserved_before_mib": round(before / 2**20, 1),
            "reserved_while_error_held_mib": round(before / 2**20 + held_mib, 1),
            "reserved_after_mib": round(after / 2**20, 1),
            "reserved_after_cublas_workspaces_mib": round(without_workspaces / 2**20, 1)}


def die_in_decode() -> dict:
    import anyio

    from astream import Engine, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
    ends: dict[int, str] = {}
    killed_at: list[float] = []

    async def main() -> dict:
        async with Engine(**engine_options(2)) as engine:
            pid = engine.core.workers.pids[0]

            async def run(i: int) -> None:
                async for tok in engine.stream(prompts(3)[i], params):
                    if i == 0 and tok.index == 20 and not killed_at:
                        killed_at.append(time.monotonic())
                        os.kill(pid, signal.SIGKILL)
                    if tok.finish_reason is not None:
                        ends[i] = f"{tok.finish_reason}: {tok.error}"

            with anyio.fail_after(120):
                async with anyio.create_task_group() as group:
                    for i in range(3):
                        group.start_soon(run, i)
            seconds = time.monotonic() - killed_at[0]
            return {"seconds": round(seconds, 2), "running": engine.running,
                    "fault": engine.stats()["fault"]}

    result = anyio.run(main)
    named = all(text.startswith("error") and "tensor-parallel rank 1 died" in text
                for text in ends.values())
    left = wait_children_gone()
    return {"ok": len(ends) == 3 and named and not result["running"] and result["seconds"] < 60
            and not left, **result, "ends": ends, "children_left": left}


def child(name: str) -> None:
    result = globals()[name]()
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------- the section (in the harness)

def run_scenario(name: str) -> dict:
    """`name` in a process of its own: its result, and the alarming lines of its stderr."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True,
                              env=env, timeout=SCENARIO_LIMIT_S)
        out, err, code = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        out, err, code = exc.stdout or "", exc.stderr or "", None
    seconds = time.monotonic() - start
    if isinstance(out, bytes):
        out, err = out.decode(errors="replace"), err.decode(errors="replace")
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    result = json.loads(lines[-1][7:]) if lines else {"ok": False, "error": "no result"}
    alarms = [line[:200] for line in err.splitlines() if ALARMS.search(line)]
    # A fault scenario logs its fault; only a clean close must stay quiet.
    quiet = not alarms if name == "clean_close" else True
    ok = bool(result.pop("ok", False)) and quiet and code == 0
    print(f"faults {name}: {'ok' if ok else 'FAILED'} in {seconds:.1f} s {result}", flush=True)
    for line in alarms[:12]:
        print(f"    stderr: {line}", flush=True)
    return {"scenario_s": seconds, "info": {"ok": ok, **result, "exit_code": code,
                                            "stderr_alarms": alarms[:40]}}


def fault_cases(options):
    from functools import partial
    for name in SCENARIOS:
        yield {"section": "faults", "scenario": name}, partial(run_scenario, name)


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in SCENARIOS:
        raise SystemExit(f"usage: tp_faults.py {{{','.join(SCENARIOS)}}}")
    child(sys.argv[1])
