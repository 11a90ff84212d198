"""KV offload on the GPU: prefill and decode speed against the resident cache and the PCIe floor.

Qwen3-4B shape, random weights, bf16. For each (context, batch): prefill tokens/s, the
decode step time once every sequence decodes, bytes moved per step, peak GPU memory;
offload on and off. The floor of an offloaded decode step is the KV it must load over
PCIe divided by the H2D bandwidth measured in this run. With offload, one more prefill
runs under the profiler to measure how much copy time is hidden under kernels
(copy_overlap.py). Then transformers' offloaded KV cache on the same model and GPU at 32K,
and a Qwen3-8B shape at 128K with offload inside a 24 GiB GPU budget.

    python benchmarks/offload.py                                   # GPU, everything -> offload.json
    python benchmarks/offload.py --cases 32768x1 --trace-ctx 131072 --skip hf,8b,resident
                                                                   # a part -> offload_cases.json
    python benchmarks/offload.py --smoke                           # CPU, tiny shape
"""

from __future__ import annotations

import argparse
import gc
import time
import traceback

import anyio
import anyio.abc
import torch

from common import Timer, percentile, save, shaped_model, synthetic_tokenizer  # noqa: I001
from copy_overlap import trace_overlap
from astream import Engine, SamplingParams

GiB = 2**30


def bandwidth() -> dict:
    host = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    result = {}
    for name, dst, src in (("h2d_GBps", dev, host), ("d2h_GBps", host, dev)):
        times = []
        for _ in range(5):
            with Timer() as t:
                dst.copy_(src, non_blocking=True)
            times.append(t.seconds)
        result[name] = round(GiB / percentile(times, 50) / 1e9, 1)
    return result


def random_prompts(ctx: int, batch: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 49152, (ctx,), generator=gen).tolist() for _ in range(batch)]


async def one_case(engine: Engine, ctx: int, batch: int, decode_tokens: int, seed: int) -> dict:
    """Prefill `batch` prompts of `ctx` tokens, then time decode steps while all of them decode.

    Sequences that finish prefill first decode during the others' prefill, so each asks for
    enough tokens to still be running for `decode_tokens` steps once all decode; the case
    ends (the rest are cancelled) when the first one finishes.
    """
    prompts = random_prompts(ctx, batch, seed)
    stats0 = engine.stats()
    chunk = stats0["max_num_batched_tokens"]
    params = SamplingParams(temperature=0.0, ignore_eos=True,
                            max_tokens=decode_tokens + (batch - 1) * -(-ctx // chunk) + 2)
    stamps: list[list[float]] = [[] for _ in range(batch)]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()

    async def consume(i: int, group: anyio.abc.TaskGroup) -> None:
        async for _ in engine.stream(prompts[i], params):
            stamps[i].append(time.perf_counter())
        group.cancel_scope.cancel()

    start = time.perf_counter()
    async with anyio.create_task_group() as group:
        for i in range(batch):
            group.start_soon(consume, i, group)
    stats1 = engine.stats()
    all_decoding = max(s[0] for s in stamps)
    tail = [b - a for s in stamps for a, b in zip(s, s[1:]) if a >= all_decoding]
    prefill_s = all_decoding - start
    return {"context": ctx, "batch": batch, "prefill_s": round(prefill_s, 3),
            "prefill_tok_s": round(ctx * batch / prefill_s, 1),
            "decode_step_ms": round(percentile(tail, 50) * 1e3, 2) if tail else None,
            "decode_steps_timed": len(tail) // batch,
            "bytes_loaded": stats1.get("offload_bytes_loaded", 0) - stats0.get("offload_bytes_loaded", 0),
            "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / GiB, 2)
            if torch.cuda.is_available() else None}


async def warm_up(engine: Engine, chunk: int) -> None:
    """Two prefill chunks and a few decode steps: compiles and first-use costs stay out of the cases."""
    prompt = random_prompts(chunk + chunk // 2, 1, seed=99)[0]
    await engine.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True))


async def traced_prefill(engine: Engine, ctx: int) -> dict:
    """Copy time hidden under compute during one prefill of `ctx` tokens (profiler trace)."""
    from torch.profiler import ProfilerActivity, profile
    prompt = random_prompts(ctx, 1, seed=77)[0]
    with profile(activities=[ProfilerActivity.CUDA]) as prof, Timer() as t:
        await engine.generate(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    return {"context": ctx, "seconds_under_profiler": round(t.seconds, 3), **trace_overlap(prof)}


async def engine_cases(config: dict, cases: list[tuple[int, int]], decode_tokens: int,
                       trace_ctx: int = 0, repeat: int = 1) -> dict:
    """Every case on one engine, `repeat` times in turn (rows carry their repetition)."""
    rows, result = [], {}
    async with Engine(**config) as engine:
        await warm_up(engine, engine.stats()["max_num_batched_tokens"])
        for rep in range(repeat):
            for i, (ctx, batch) in enumerate(cases):
                # New prompts each repetition: the prefix cache must not serve a repeat.
                seed = rep * len(cases) + i
                rows.append({**await one_case(engine, ctx, batch, decode_tokens, seed=seed), "rep": rep})
                print(rows[-1], flush=True)
        if trace_ctx:
            result["prefill_copy_overlap"] = await traced_prefill(engine, trace_ctx)
            print(result["prefill_copy_overlap"], flush=True)
    return {"rows": rows, **result}


def hf_offloaded_cache(folder, ctx: int, new_tokens: int) -> dict:
    """transformers' own offloaded KV cache: ms per decode token at `ctx`, against its resident cache."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(folder)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    ids = torch.randint(100, 49152, (1, ctx), device="cuda")
    result = {}
    for name, cache in (("offloaded", "offloaded"), ("resident", None)):
        times = {}
        for n in (1, 1 + new_tokens):
            kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            if cache:
                kw["cache_implementation"] = cache
            with torch.no_grad(), Timer() as t:
                model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            times[n] = t.seconds
        result[f"{name}_ms_per_token"] = round((times[1 + new_tokens] - times[1]) / new_tokens * 1e3, 1)
    del model
    return result


def section(results: dict, name: str, fn, *args) -> None:
    try:
        results[name] = fn(*args)
    except Exception as exc:                 # record it and go on with the next section
        traceback.print_exc()
        results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def configs(args, folder, max_pos: int) -> tuple[dict, dict, list, list]:
    """Engine keywords for both modes, and the (context, batch) cases each runs."""
    smoke = args.smoke
    base = dict(model=str(folder), load_format="dummy", tokenizer=args.tokenizer or synthetic_tokenizer(),
                device="cpu" if smoke else "cuda", dtype="float32" if smoke else "bfloat16",
                max_num_seqs=4, max_model_len=max_pos)
    if not smoke:
        base["max_num_batched_tokens"] = 16384       # the same prefill chunks in both modes
    # 128K x 4 needs 77 GB of KV: offload only (the host pool is sized for it).
    resident_cases = [(256, 1), (256, 2)] if smoke else [(32768, 1), (32768, 4), (131072, 1)]
    offload_cases = resident_cases + ([(512, 2)] if smoke else [(131072, 4)])
    if args.cases:
        resident_cases = offload_cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    # The host pool holds the largest case and max_model_len (256-token blocks), plus decode room.
    pool_blocks = max(max_pos, *(c * b for c, b in offload_cases)) // 256 + 32
    offload_cfg = {**base, "offload": True, **({"kv_block_size": 16, "offload_slot_tokens": 64}
                                                 if smoke else {"num_kv_blocks": pool_blocks})}
    return base, offload_cfg, resident_cases, offload_cases


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--skip", default="", help="comma list of sections to skip")
    parser.add_argument("--tokenizer", default=None, help="any tokenizer (prompts are random ids)")
    parser.add_argument("--cases", default=None, help='e.g. "65536x1,32768x4": only these, both modes')
    parser.add_argument("--trace-ctx", type=int, default=65536, help="traced prefill length, 0 = none")
    parser.add_argument("--repeat", type=int, default=1, help="runs of every case on one engine")
    parser.add_argument("--name", default=None, help="results file name")
    args = parser.parse_args()
    smoke, skip = args.smoke, set(args.skip.split(","))
    shape, max_pos = ("tiny", 4096) if smoke else ("qwen3-4b", 131072 + 1024)
    folder = shaped_model(shape, max_positions=max_pos)
    base, offload_cfg, resident_cases, offload_cases = configs(args, folder, max_pos)
    decode_tokens = 6 if smoke else 17
    results: dict = {"shape": shape, "cases": "(context, batch)"}
    name = args.name or ("offload_cases" if args.cases else "offload")   # a partial run keeps the full file
    if not smoke:
        section(results, "bandwidth", bandwidth)
    if "offload" not in skip:
        trace_ctx = 0 if smoke else args.trace_ctx
        section(results, "offload", lambda: anyio.run(engine_cases, offload_cfg, offload_cases,
                                                      decode_tokens, trace_ctx, args.repeat))
        save(name, results, smoke=smoke)
    if "resident" not in skip:
        section(results, "resident", lambda: anyio.run(engine_cases, base, resident_cases, decode_tokens,
                                                       0, args.repeat))
        save(name, results, smoke=smoke)
    if not smoke and "hf" not in skip:
        section(results, "transformers_32k", hf_offloaded_cache, folder, 32768, 8)
        save(name, results)
    if not smoke and "8b" not in skip:
        total = torch.cuda.get_device_properties(0).total_memory
        big = shaped_model("qwen3-8b", max_positions=max_pos)
        cfg8 = {**base, "model": str(big), "offload": True, "max_num_seqs": 1, "num_kv_blocks": 520,
                "gpu_memory_utilization": round(24 * GiB / total, 3)}
        section(results, "qwen3_8b_128k_in_24gib",
                lambda: anyio.run(engine_cases, cfg8, [(131072, 1)], 4))
    summarize(results, smoke, name)


def spread_by_case(rows: list[dict]) -> dict:
    """min / median / max over repetitions, per case, of decode step and prefill speed."""
    cases: dict = {}
    for row in rows:
        cases.setdefault(f"{row['context']}x{row['batch']}", []).append(row)
    out = {}
    for case, reps in cases.items():
        out[case] = {}
        for key in ("decode_step_ms", "prefill_tok_s", "step_over_floor"):
            values = sorted(r[key] for r in reps if r.get(key) is not None)
            if values:
                out[case][key] = {"min": values[0], "median": values[len(values) // 2], "max": values[-1]}
    return out


def summarize(results: dict, smoke: bool, name: str) -> None:
    h2d = results.get("bandwidth", {}).get("h2d_GBps")
    kv_per_token = 147456                            # Qwen3-4B: 36 layers x 8 heads x 128 x 2 x 2 bytes
    rows = {mode: results[mode].get("rows", []) if isinstance(results.get(mode), dict) else []
            for mode in ("offload", "resident")}
    for row in rows["offload"]:
        if h2d:
            floor_ms = row["context"] * row["batch"] * kv_per_token / (h2d * 1e9) * 1e3
            row["floor_ms"] = round(floor_ms, 1)
            if row["decode_step_ms"]:
                row["step_over_floor"] = round(row["decode_step_ms"] / floor_ms, 3)
    results["spread"] = {mode: spread_by_case(mode_rows) for mode, mode_rows in rows.items()}
    resident = {(r["context"], r["batch"]): r for r in rows["resident"]}
    results["prefill_offload_vs_resident"] = {
        f"{a['context']}x{a['batch']}": round(a["prefill_tok_s"] / resident[key]["prefill_tok_s"], 3)
        for a in rows["offload"] if (key := (a["context"], a["batch"])) in resident}
    save(name, results, smoke=smoke)
    for key, value in results.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
