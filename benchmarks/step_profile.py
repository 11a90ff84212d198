"""Where the time of a throughput step goes: GPU busy time, top kernels, host hotspots.

The throughput workload (256 requests, input and output lengths uniform in 100..1024) on
the Qwen3-0.6B shape, through the async Engine on this thread. Run 1 traces the GPU over
`--window` steps from the middle of the run (busy time = union of kernel intervals). Run 2
repeats the workload under cProfile, which sees every stage since all run on this thread
(it slows the host, so only its proportions mean anything).

    python benchmarks/step_profile.py            # GPU
    python benchmarks/step_profile.py --smoke    # CPU, tiny shape
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import anyio
import torch

from common import random_workload, save, shaped_model, smollm2  # noqa: I001
from copy_overlap import trace_events, union_intervals
from astream import Engine, SamplingParams


async def workload(engine: Engine, work, on_step=None) -> None:
    async def one(prompt: list[int], out: int) -> None:
        await engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True))

    async with anyio.create_task_group() as group:
        for prompt, out in work:
            group.start_soon(one, prompt, out)
        if on_step is not None:
            group.start_soon(on_step)


async def wait_steps(engine: Engine, n: int) -> None:
    while engine.stats()["steps"] < n:
        await anyio.sleep(0.002)


def kernel_summary(prof, steps: int, wall_s: float) -> dict:
    kernels = [e for e in trace_events(prof) if e.get("cat") == "kernel"]
    busy_us = sum(b - a for a, b in union_intervals([(e["ts"], e["ts"] + e["dur"]) for e in kernels]))
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e["name"][:90], []).append(e["dur"])
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]
    return {"steps": steps, "wall_ms_per_step": round(wall_s * 1e3 / steps, 2),
            "gpu_busy_ms_per_step": round(busy_us / 1e3 / steps, 2),
            "gpu_busy_fraction": round(busy_us / 1e6 / wall_s, 3),
            "top_kernels": [{"name": n, "calls_per_step": round(len(d) / steps, 1),
                             "ms_per_step": round(sum(d) / 1e3 / steps, 3)} for n, d in top]}


async def traced_run(config: dict, work, start: int, window: int) -> dict:
    from torch.profiler import ProfilerActivity, profile
    result: dict = {}
    async with Engine(**config) as engine:
        await engine.generate([1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True))
        base = engine.stats()["steps"]

        async def tracer() -> None:
            await wait_steps(engine, base + start)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                first, t0 = engine.stats()["steps"], time.perf_counter()
                await wait_steps(engine, first + window)
                torch.cuda.synchronize()
                steps, wall = engine.stats()["steps"] - first, time.perf_counter() - t0
            result.update(kernel_summary(prof, steps, wall))

        t0 = time.perf_counter()
        await workload(engine, work, tracer if torch.cuda.is_available() else None)
        result["total_s"], result["total_steps"] = round(time.perf_counter() - t0, 3), \
            engine.stats()["steps"] - base
    return result


def host_profile(config: dict, work) -> str:
    profiler = cProfile.Profile()

    async def main() -> None:
        async with Engine(**config) as engine:      # loading stays out of the profile
            profiler.enable()
            await workload(engine, work)
            profiler.disable()

    anyio.run(main, backend_options={"use_uvloop": True})
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(30)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--window", type=int, default=60)
    args = parser.parse_args()
    shape = "tiny" if args.smoke else "qwen3-0.6b"
    config = dict(model=str(shaped_model(shape, max_positions=4096)), load_format="dummy",
                  tokenizer=smollm2(), device="cpu" if args.smoke else "cuda",
                  dtype="float32" if args.smoke else "bfloat16", max_num_seqs=256, max_model_len=2112)
    work = random_workload(16, 10, 40, 5, 20) if args.smoke else random_workload(256, 100, 1024, 100, 1024)
    traced = anyio.run(traced_run, config, work, 300, args.window, backend_options={"use_uvloop": True})
    print(json.dumps(traced, indent=1))
    host = host_profile(config, work)
    print(host)
    save("step_profile", {"shape": shape, "gpu_window": traced, "host_cprofile_top30": host},
         smoke=args.smoke)


if __name__ == "__main__":
    main()
