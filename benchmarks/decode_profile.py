"""Where a resident decode step's time goes, per decoder kernel set: kernels per step, GPU
busy time, the wall time of a replayed (CUDA graph) step and of an eager one, top kernels.

Qwen3-4B shape, random weights, bf16, one sequence of `--ctx` tokens, Full attention (or
Quest with `--budget`). The same engine and sequence run each `--layer-kernels` set in turn
(the graphs are captured again for each), so the sets are compared side by side.

    python benchmarks/decode_profile.py [--ctx 32768] [--budget 4096]
    python benchmarks/decode_profile.py --smoke          # CPU, tiny shape (eager only)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from common import percentile, save, shaped_model, synthetic_tokenizer  # noqa: I001
from copy_overlap import trace_events, union_intervals
from quest import FULL, decode_steps, set_budget
from astream.base.config import EngineConfig
from astream.base.sampling import SamplingParams
from astream.core.engine_core import EngineCore
from astream.policies import QuestPolicy


def kernel_timeline(kernels: list[dict], start: int, count: int) -> list[str]:
    """`count` kernels in launch order from index `start`: name, duration and the idle gap
    since the previous kernel ended, in microseconds."""
    ordered = sorted(kernels, key=lambda e: e["ts"])
    lines = []
    for prev, e in zip(ordered[start - 1:start + count - 1], ordered[start:start + count]):
        gap = e["ts"] - (prev["ts"] + prev["dur"])
        lines.append(f"{e['dur']:7.1f} us  gap {gap:5.1f}  {e['name'][:70]}")
    return lines


def kernel_breakdown(core: EngineCore, steps: int, top: int = 10) -> dict:
    """Kernels launched per step, GPU busy ms per step (union of kernel intervals), top kernels,
    and the kernels of one layer-sized window in the middle of the first step, in order."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decode_steps(core, steps)
    events = trace_events(prof)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    busy = sum(b - a for a, b in union_intervals([(e["ts"], e["ts"] + e["dur"]) for e in kernels]))
    copy_busy = sum(b - a for a, b in union_intervals([(e["ts"], e["ts"] + e["dur"]) for e in copies]))
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e["name"][:80], []).append(e["dur"])
    heaviest = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"kernels_per_step": round(len(kernels) / steps, 1),
            "gpu_busy_ms_per_step": round(busy / 1e3 / steps, 3),
            "copies_per_step": round(len(copies) / steps, 1),
            "copy_busy_ms_per_step": round(copy_busy / 1e3 / steps, 3),
            "top_kernels": [{"name": n, "per_step": round(len(d) / steps, 1),
                             "ms_per_step": round(sum(d) / 1e3 / steps, 3)} for n, d in heaviest],
            "mid_step_kernels": kernel_timeline(kernels, len(kernels) // steps // 2,
                                                -(-len(kernels) // steps // core.model.decoder.config.num_layers) + 4)}


def median_ms(times: list[float]) -> float:
    return round(percentile(times, 50) * 1e3, 3)


def host_hotspots(core: EngineCore, steps: int, top: int = 25) -> list[str]:
    """cProfile of eager steps: the functions with the most own host time (tottime), then the
    engine's functions with the most time under them (cumtime)."""
    profiler = cProfile.Profile()
    profiler.enable()
    decode_steps(core, steps)
    profiler.disable()
    lines = []
    for order, pattern in (("tottime", ""), ("cumtime", "astream")):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(pattern, top)
        lines += [line for line in text.getvalue().splitlines() if line.strip()][-top - 1:]
    return lines


def profile_kernels(core: EngineCore, kernels: str, budget: int, steps: int,
                    host_profile: bool = False, top: int = 10) -> dict:
    set_budget(core, budget, kernels)                 # captures graphs (None on the CPU)
    decode_steps(core, 3)
    graphed = median_ms(decode_steps(core, steps)) if core.runner.graphs is not None else None
    result = {"layer_kernels": kernels, "graph_step_ms": graphed}
    if core.runner.graphs is not None:
        result["graph"] = kernel_breakdown(core, 3, top) if torch.cuda.is_available() else {}
    graphs, core.runner.graphs = core.runner.graphs, None
    decode_steps(core, 2)
    result["eager_step_ms"] = median_ms(decode_steps(core, steps))
    if torch.cuda.is_available():
        result["eager"] = kernel_breakdown(core, 3, top)
    if host_profile:
        result["eager_host_top"] = host_hotspots(core, steps)
    core.runner.graphs = graphs
    print(result, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: common.synthetic_tokenizer())")
    parser.add_argument("--ctx", type=int, default=32768)
    parser.add_argument("--budget", default="full", help="full, or a Quest budget in tokens")
    parser.add_argument("--layer-kernels", default="reference,triton", help="(smoke: reference)")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--host-profile", action="store_true", help="cProfile the eager steps")
    parser.add_argument("--offload", action="store_true", help="KV in the host pool (Full: eager ring steps)")
    parser.add_argument("--top", type=int, default=10, help="kernels listed, heaviest first")
    args = parser.parse_args()
    shape, ctx = ("tiny", 256) if args.smoke else ("qwen3-4b", args.ctx)
    budget = FULL if args.budget == "full" else int(args.budget)
    config = EngineConfig(model=str(shaped_model(shape, max_positions=ctx + 1024)),
                          load_format="dummy", tokenizer=args.tokenizer or synthetic_tokenizer(),
                          device="cpu" if args.smoke else "cuda",
                          dtype="float32" if args.smoke else "bfloat16", max_num_seqs=1,
                          max_model_len=ctx + 1024, kv_cache_dtype=args.kv_cache_dtype,
                          sparse_policy=QuestPolicy(budget_tokens=FULL, dense_layers=2),
                          max_num_batched_tokens=16384, offload=args.offload,
                          **({"num_kv_blocks": (ctx + 1024) // 256 + 64} if args.offload else {}))
    core = EngineCore.create(config)
    prompt = torch.randint(100, 49152, (ctx,), generator=torch.Generator().manual_seed(0)).tolist()
    sink = core.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=100_000,
                                                        ignore_eos=True))
    start = time.perf_counter()
    while not sink.tokens:
        core.step()
    core.runtime.synchronize()
    results = {"shape": shape, "context": ctx, "budget": args.budget, "kv": args.kv_cache_dtype,
               "prefill_s": round(time.perf_counter() - start, 2),
               "runs": [profile_kernels(core, k, budget, 3 if args.smoke else args.steps,
                                               args.host_profile, args.top)
                        for k in (("reference",) if args.smoke else args.layer_kernels.split(","))]}
    mode = "_offload" if args.offload else ""
    save(f"decode_profile{mode}_{args.budget}_{ctx}_{args.kv_cache_dtype}", results, smoke=args.smoke)
    core.close()


if __name__ == "__main__":
    main()
