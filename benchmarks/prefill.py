"""Prefill attention kernels and end-to-end prefill speed: FlashAttention-2 against cuDNN.

Three sections, on one process and one device, each kernel set side by side:

- kernels: every part a chunked prefill is made of (the causal square of a chunk over
  itself, a chunk over an earlier prefix without a mask, and a chunk after its prefix as
  the engine calls it), Qwen3-4B heads (32 query, 8 KV, 128 wide), bf16. Errors against
  the float32 torch reference on smaller shapes first; then milliseconds and TFLOP/s.
- engine: prompts of --contexts tokens prefilled by EngineCore (Qwen3-4B shape, random
  weights), resident or --offload, --chunk tokens a step, in tokens per second; each
  kernel set prefills fresh prompts --repeat times in turn.

- plans: what cuDNN's execution plans cost (run it alone, in a fresh process): the startup
  warm-up of every shape a server with --chunk-token steps and --plan-context tokens of
  context meets (ops.cudnn_attention.warm_up), a shape off the ladder built on first use,
  and chunks of ragged lengths after it through the engine's path, first call against the
  next ones (planned at startup, the first call costs what the others do).

    python benchmarks/prefill.py [--sections kernels,engine] [--offload] [--repeat 3]
    python benchmarks/prefill.py --sections plans --chunk 8192 --plan-context 32768
    python benchmarks/prefill.py --smoke          # CPU, tiny shapes: checks the script only
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time

import torch

from common import cuda_times_ms, percentile, save, shaped_model, synthetic_tokenizer  # noqa: I001
from astream.base.config import EngineConfig
from astream.base.sampling import SamplingParams
from astream.core.engine_core import EngineCore
from astream.executor.inputs import varlen_meta
from astream.ops import cudnn_attention
from astream.ops.attention_ref import varlen_attention_ref
from astream.ops.backends import AttentionBackends

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
# (queries, prefix keys, causal): the square of a chunk, a chunk over a prefix, both at once.
ERROR_CASES = [(3000, 0, True), (2048, 5000, False), (2500, 1000, True), (4096, 0, True)]
# Where cuDNN starts to pay (ops.backends.CUDNN_MIN_QUERIES): --small.
SMALL_CASES = [(512, 0, True), (1024, 0, True), (2048, 0, True), (4096, 0, True),
               (1024, 4096, False), (2048, 8192, False)]
SPEED_CASES = [(8192, 0, True), (16384, 0, True), (32768, 0, True), (16384, 16384, False),
               (16384, 65536, False), (16384, 114688, False), (16384, 114688, True)]


def flops(n_q: int, prefix: int, causal: bool) -> float:
    """Multiply-adds of QK^T and PV, twice each, counting only the visible half of a square."""
    visible = n_q * prefix + (n_q * (n_q + 1) / 2 if causal else 0)
    return 4 * visible * HEAD_DIM * HEADS


def inputs(n_q: int, prefix: int, causal: bool, device: str, dtype: torch.dtype, seed: int):
    n_k = prefix + (n_q if causal else 0)
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(n_q, HEADS, HEAD_DIM, device=device, dtype=dtype, generator=gen)
    k = torch.randn(n_k, KV_HEADS, HEAD_DIM, device=device, dtype=dtype, generator=gen)
    v = torch.randn(n_k, KV_HEADS, HEAD_DIM, device=device, dtype=dtype, generator=gen)
    return q, k, v, varlen_meta([0, n_q], [0, n_k], torch.device(device))


def kernel_sets(device: str) -> dict[str, AttentionBackends]:
    chosen = AttentionBackends.select(torch.device(device), torch.bfloat16, HEAD_DIM)
    sets = {"flash": dataclasses.replace(chosen, cudnn_prefill=False)}
    if chosen.cudnn_prefill:
        sets["cudnn"] = chosen
    return sets


def kernel_errors(device: str, sets: dict, smoke: bool) -> list[dict]:
    rows = []
    for i, (n_q, prefix, causal) in enumerate(ERROR_CASES[:1] if smoke else ERROR_CASES):
        q, k, v, meta = inputs(n_q, prefix, causal, device, torch.bfloat16, seed=i)
        ref_out, ref_lse = varlen_attention_ref(q.float(), k.float(), v.float(), meta,
                                                causal=causal, scale=HEAD_DIM ** -0.5)
        for name, backends in sets.items():
            out, lse = backends.varlen(q, k, v, meta, causal=causal, scale=HEAD_DIM ** -0.5)
            err = ((out.float() - ref_out).abs().max() / ref_out.abs().max()).item()
            rows.append({"queries": n_q, "prefix": prefix, "causal": causal, "kernels": name,
                         "out_rel_err": round(err, 6),
                         "lse_max_abs_err": round((lse - ref_lse).abs().max().item(), 6)})
            print(rows[-1], flush=True)
    return rows


def part(name: str, backends: AttentionBackends, q, k, v, meta, causal: bool):
    """One prefill part on the named kernels; cuDNN whatever the part's size (below the
    engine's CUDNN_MIN_QUERIES too, to find where it starts to pay)."""
    scale = HEAD_DIM ** -0.5
    if name == "cudnn":
        return cudnn_attention.one_sequence(cudnn_attention.cudnn_dense, backends.merge_into_rows,
                                            q, k, v, causal=causal, scale=scale)
    return backends.varlen(q, k, v, meta, causal=causal, scale=scale)


def kernel_speed(sets: dict, reps: int, cases: list) -> list[dict]:
    rows = []
    for i, (n_q, prefix, causal) in enumerate(cases):
        q, k, v, meta = inputs(n_q, prefix, causal, "cuda", torch.bfloat16, seed=100 + i)
        for name, backends in sets.items():
            times = cuda_times_ms(lambda: part(name, backends, q, k, v, meta, causal), reps)
            ms = percentile(times, 50)
            rows.append({"queries": n_q, "prefix": prefix, "causal": causal, "kernels": name,
                         "ms_min": round(min(times), 3), "ms": round(ms, 3),
                         "ms_max": round(max(times), 3),
                         "tflops": round(flops(n_q, prefix, causal) / ms / 1e9, 1)})
            print(rows[-1], flush=True)
    return rows


# (queries, prefix keys): chunks of lengths the scheduler cuts, none a power of two.
PLAN_CASES = [(7168, 13312), (3072, 5120), (6144, 25600), (5120, 1024)]


def first_and_next_ms(fn, reps: int) -> dict:
    """Wall milliseconds of fn's first call (a plan built then shows here) and the median of
    the next `reps`, each to the device's completion."""
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return {"first_ms": round(times[0], 2), "next_ms": round(percentile(times[1:], 50), 2)}


def plan_costs(chunk: int, context: int, reps: int) -> dict:
    device = torch.device("cuda")
    backends = AttentionBackends.select(device, torch.bfloat16, HEAD_DIM)
    if not backends.cudnn_prefill:
        return {"skipped": "cuDNN prefill is not used on this device"}
    scale = HEAD_DIM ** -0.5
    torch.cuda.synchronize()
    start = time.perf_counter()
    count = cudnn_attention.warm_up(cudnn_attention.cudnn_dense, backends.merge_into_rows, chunk,
                                    context, HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, device, scale)
    torch.cuda.synchronize()
    result = {"chunk": chunk, "context": context, "shapes": count,
              "warm_up_s": round(time.perf_counter() - start, 3)}
    print(result, flush=True)
    off = inputs(3000, 0, True, "cuda", torch.bfloat16, seed=7)
    result["off_ladder_3000_square"] = first_and_next_ms(
        lambda: cudnn_attention.cudnn_dense(*off[:3], causal=True, scale=scale), reps)
    print(result["off_ladder_3000_square"], flush=True)
    rows = []
    for i, (n_q, prefix) in enumerate(PLAN_CASES):
        if n_q > chunk or n_q + prefix > context:
            continue
        q, k, v, meta = inputs(n_q, prefix, True, "cuda", torch.bfloat16, seed=20 + i)
        rows.append({"queries": n_q, "prefix": prefix, **first_and_next_ms(
            lambda: backends.varlen(q, k, v, meta, causal=True, scale=scale), reps)})
        print(rows[-1], flush=True)
    result["chunks"] = rows
    return result


def prefill_seconds(core: EngineCore, ctx: int, seed: int) -> float:
    prompt = torch.randint(100, 49152, (ctx,), generator=torch.Generator().manual_seed(seed)).tolist()
    core.runtime.synchronize()
    start = time.perf_counter()
    sink = core.add_request(f"p{seed}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while not sink.tokens:
        core.step()
    core.runtime.synchronize()
    seconds = time.perf_counter() - start
    while core.step():                       # let the request finish and free its blocks
        pass
    return seconds


def engine_speed(config: EngineConfig, contexts: list[int], repeat: int) -> list[dict]:
    core = EngineCore.create(config)
    try:
        sets = kernel_sets(str(config.device)) if config.device != "cpu" else {"flash": None}
        chosen = core.runner.backends
        prefill_seconds(core, min(contexts), seed=10_000)       # warm-up: first-use costs
        rows, seed = [], 0
        for ctx in contexts:
            times: dict[str, list[float]] = {name: [] for name in sets}
            for _ in range(repeat):
                for name, backends in sets.items():
                    core.runner.backends = backends or chosen
                    seed += 1
                    times[name].append(prefill_seconds(core, ctx, seed))
            for name, secs in times.items():
                rows.append({"context": ctx, "kernels": name, "offload": config.offload,
                             "tok_s": [round(ctx / s) for s in secs],
                             "tok_s_median": round(ctx / percentile(secs, 50))})
                print(rows[-1], flush=True)
        return rows
    finally:
        core.close()
        del core
        gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--sections", default="kernels,engine")
    parser.add_argument("--contexts", default="8192,32768,131072")
    parser.add_argument("--chunk", type=int, default=16384, help="prefill tokens a step")
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--plan-context", type=int, default=32768, help="plans: the server's max_model_len")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5, help="timed calls per kernel case")
    parser.add_argument("--small", action="store_true", help="kernels: the small parts (threshold)")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: common.synthetic_tokenizer())")
    parser.add_argument("--name", default="prefill")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    results: dict = {"sections": args.sections}
    sections = args.sections.split(",")
    if "plans" in sections and not args.smoke:
        results["plans"] = plan_costs(args.chunk, args.plan_context, args.reps)
        save(args.name, results, smoke=args.smoke)
    if "kernels" in sections:
        sets = kernel_sets(device)
        results["kernel_errors"] = kernel_errors(device, sets, args.smoke)
        if not args.smoke:
            results["kernel_speed"] = kernel_speed(sets, args.reps, SMALL_CASES if args.small else SPEED_CASES)
        save(args.name, results, smoke=args.smoke)
    if "engine" in sections:
        shape, contexts = ("tiny", [512]) if args.smoke else ("qwen3-4b", [int(c) for c in args.contexts.split(",")])
        max_pos = max(contexts) + 1024
        config = EngineConfig(model=str(shaped_model(shape, max_positions=max_pos)), load_format="dummy",
                              tokenizer=args.tokenizer or synthetic_tokenizer(), device=device,
                              dtype="float32" if args.smoke else "bfloat16", max_num_seqs=1,
                              max_model_len=max_pos, max_num_batched_tokens=256 if args.smoke else args.chunk,
                              offload=args.offload,
                              **({"num_kv_blocks": max_pos // 256 + 8} if args.offload and not args.smoke else {}))
        results["engine"] = engine_speed(config, contexts, 1 if args.smoke else args.repeat)
        save(args.name, results, smoke=args.smoke)


if __name__ == "__main__":
    main()
