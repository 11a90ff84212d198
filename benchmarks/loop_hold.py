"""How long one step holds the engine's event loop, for long prompt chunks.

On CUDA the async engine enqueues a step on its event-loop thread (stages/forward.py):
the batch's inputs are prepared, then the step program runs layer by layer, and the
driver gives the loop a turn between stretches of it. While a stretch runs, no token
reaches a client and no new request is admitted, so the longest stretch adds to every
request's latency while long prompts prefill. This times, per step, on one thread with
the device free-running as in the engine:

- `schedule_ms` and `prepare_ms` (the batch and its device inputs),
- each stretch of the step program between two of its yields (`layer_ms`: max and mean),
- the longest hold the driver allows (`hold_ms`: `prepare` plus the stretches the driver
  runs back to back before it gives the loop a turn, runtime.events.CHECKPOINT_EVERY),
- `device_ms`, the step's own time on the device (from its launch to its ids' readback).

A stretch that takes about as long as the device needs for a layer waits on the device
(a synchronizing call); one far shorter is host work only.

Qwen3-0.6B shape, random weights, bf16, Full attention, `--prompts` prompts of `--ctx`
tokens prefilled in chunks of `--budget` tokens (the step's token budget).

    python benchmarks/loop_hold.py [--ctx 16384] [--prompts 2] [--budget 8192]
    python benchmarks/loop_hold.py --smoke          # CPU, tiny shape
"""

from __future__ import annotations

import argparse
import time

import torch

from common import engine_core, percentile, save, shaped_model, synthetic_tokenizer  # noqa: I001
from astream.base.config import EngineConfig
from astream.base.sampling import SamplingParams
from astream.runtime.events import CHECKPOINT_EVERY


def timed_step(core) -> dict | None:
    """One step, its phases timed on the host; None when nothing is scheduled."""
    t0 = time.perf_counter()
    batch = core.schedule()
    t1 = time.perf_counter()
    step = core.prepare(batch) if batch is not None else None
    t2 = time.perf_counter()
    if step is None:
        return None
    program = core.program(step, None)
    stretches, output = [], None
    while output is None:
        start = time.perf_counter()
        try:
            next(program)
        except StopIteration as stop:
            output = stop.value
        finally:
            stretches.append(time.perf_counter() - start)
    launched = time.perf_counter()
    output.ready.synchronize()
    done = time.perf_counter()
    core.process(output)
    holds = [sum(stretches[i:i + CHECKPOINT_EVERY]) for i in range(0, len(stretches), CHECKPOINT_EVERY)]
    holds[0] += t2 - t1
    return {"prefill_tokens": sum(i.num_tokens for i in batch.items if i.num_tokens > 1),
            "schedule_ms": 1e3 * (t1 - t0), "prepare_ms": 1e3 * (t2 - t1),
            "layer_ms_max": 1e3 * max(stretches), "layer_ms_mean": 1e3 * sum(stretches) / len(stretches),
            "stretches": len(stretches), "hold_ms": 1e3 * max(holds),
            "device_ms": 1e3 * (done - t2), "launch_ms": 1e3 * (launched - t2)}


def engine_config(ctx: int, budget: int, smoke: bool) -> EngineConfig:
    return EngineConfig(model=str(shaped_model("tiny" if smoke else "qwen3-0.6b", max_positions=ctx + 64)),
                        load_format="dummy", tokenizer=synthetic_tokenizer(),
                        device="cpu" if smoke else "cuda", dtype="float32" if smoke else "bfloat16",
                        max_num_seqs=4, max_model_len=ctx + 64, max_num_batched_tokens=budget,
                        enable_prefix_caching=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ctx", type=int, default=16384)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--budget", type=int, default=8192)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    smoke = args.smoke or not torch.cuda.is_available()
    ctx, budget = (512, 256) if smoke else (args.ctx, args.budget)
    rows = []
    with engine_core(engine_config(ctx, budget, smoke)) as core:
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        for rep in range(2):                    # the first pass warms up (kernels, plans)
            gen = torch.Generator().manual_seed(rep)
            for i in range(args.prompts):
                core.add_request(f"r{rep}-{i}", torch.randint(100, 30000, (ctx,), generator=gen).tolist(),
                                 params)
            while (row := timed_step(core)) is not None:
                if rep:
                    rows.append(row)
    keys = ("prefill_tokens", "prepare_ms", "layer_ms_max", "layer_ms_mean", "hold_ms", "launch_ms", "device_ms")
    print("  ".join(f"{k:>14}" for k in keys))
    for row in rows:
        print("  ".join(f"{row[k]:>14.2f}" if isinstance(row[k], float) else f"{row[k]:>14}" for k in keys))
    long_steps = [r for r in rows if r["prefill_tokens"] >= budget // 2]
    summary = {k: round(percentile([r[k] for r in long_steps], 50), 3) for k in keys[1:]} if long_steps else {}
    print(f"median over {len(long_steps)} steps of at least {budget // 2} prompt tokens: {summary}")
    save("loop_hold", {"benchmark": "loop_hold", "ctx": ctx, "prompts": args.prompts, "budget": budget,
                       "checkpoint_every": CHECKPOINT_EVERY, "steps": rows, "median_long": summary},
         smoke=smoke)


if __name__ == "__main__":
    main()
