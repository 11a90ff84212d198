"""Quest decode speed against Full, resident and with offload, on one engine per mode.

Qwen3-4B shape, random weights, bf16. For each (context, batch) case the prompts are
prefilled once; then every budget (Full, 1K, 2K, 4K tokens) decodes the same sequences in
turn: the engine's Quest runtime is given the budget (Full = a budget no context reaches,
which takes the dense path) and, resident, the CUDA graphs are captured again. Steps are
timed two ways: synchronously (EngineCore.step with the device synchronized, so a step is
its whole latency, host work included), and pipelined as the engine's stages run them (the
next step is scheduled, prepared and launched before the previous one's tokens are read
back, so host work hides behind the device): the interval between consecutive steps'
results. With offload, bytes moved per step: ring loads (Full) or gathered pages (with
--reuse-pages, only the pages a row's slots did not already hold).

    python benchmarks/quest.py                 # GPU -> quest_speed.json
    python benchmarks/quest.py --smoke         # CPU, tiny shape
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time

import torch

from common import engine_core, percentile, save, shaped_model, smollm2  # noqa: I001
from astream.config import EngineConfig
from astream.core import EngineCore
from astream.executor.build import build_graphs
from astream.ops.layer_kernels import LayerKernels
from astream.policies import QuestPolicy
from astream.sampling import SamplingParams

FULL = 1 << 40                                   # a budget no context reaches: the dense path
PAGE_ELEMENTS = 16 * 128 * 2                     # one KV head's page: 16 tokens x 128 x K,V


def decode_steps(core: EngineCore, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        core.runtime.synchronize()
        start = time.perf_counter()
        core.step()
        core.runtime.synchronize()
        times.append(time.perf_counter() - start)
    return times


def pipelined_steps(core: EngineCore, steps: int) -> list[float]:
    """Intervals between consecutive steps' results when step n+1 is launched before step n
    is read back, as the engine's schedule and forward stages do."""
    core.runtime.synchronize()
    times, previous, last = [], None, time.perf_counter()
    for _ in range(steps + 1):
        core.resume_caught_up()
        output = core.launch(core.prepare(core.schedule()), previous)
        if previous is not None:
            previous.ready.synchronize()
            core.process(previous)
            now = time.perf_counter()
            times.append(now - last)
            last = now
        previous = output
    previous.ready.synchronize()
    core.process(previous)
    return times[1:]


def set_budget(core: EngineCore, budget: int, kernels: str, dense_graphs: str = "auto") -> None:
    runtime = core.runner.policy
    runtime.policy = QuestPolicy(budget_tokens=budget, dense_layers=runtime.policy.dense_layers,
                                 reuse_pages=runtime.policy.reuse_pages)
    core.runner.decoder.kernels = LayerKernels(kernels)
    # Graphs bake the selection and the kernels in: capture again. --eager keeps every step eager.
    core.runner.graphs = None
    gc.collect()
    core.runner.graphs = graphs = build_graphs(core.config, core.plan, core.runner)
    # With offload, a policy that never selects (Full) loads whole contexts between a chain of
    # graphs; "never" measures the eager ring instead.
    if graphs is not None and getattr(graphs, "dense", False) and dense_graphs == "never":
        core.runner.graphs = None


def one_case(core: EngineCore, ctx: int, batch: int, budgets: list[int], steps: int, seed: int,
             kernel_sets: list[str], dense_graphs: str) -> list:
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    sinks = [core.add_request(f"c{seed}-{i}", torch.randint(100, 49152, (ctx,), generator=gen).tolist(),
                              params) for i in range(batch)]
    start = time.perf_counter()
    while not all(sink.tokens for sink in sinks):
        core.step()
    core.runtime.synchronize()
    prefill_s = time.perf_counter() - start
    rows = []
    for kernels in kernel_sets:
        for budget in budgets:
            set_budget(core, budget, kernels, dense_graphs)
            decode_steps(core, 2)                                # warm-up (and Triton compiles)
            before = core.stats()
            times = decode_steps(core, steps)
            after = core.stats()
            pipelined = pipelined_steps(core, steps + 1)
            rows.append({**row(ctx, batch, budget, times, before, after, steps, prefill_s),
                         **spread("pipelined_step_ms", pipelined),
                         "layer_kernels": kernels, "dense_graphs": dense_graphs,
                         "graph_steps": after["graph_steps"] - before["graph_steps"]})
            print(rows[-1], flush=True)
    for i in range(batch):
        core.abort(f"c{seed}-{i}")
    return rows


def row(ctx, batch, budget, times, before, after, steps, prefill_s) -> dict:
    loaded = after.get("offload_bytes_loaded", 0) - before.get("offload_bytes_loaded", 0)
    counter = "quest_pages_loaded" if any(after.get("quest_pages_loaded", [])) else "quest_pages_read"
    pages = sum(after.get(counter, [0])) - sum(before.get(counter, [0]))
    element = 1 if after["kv_cache_dtype"].startswith("float8") else 2
    gathered = pages * PAGE_ELEMENTS * element if after["offload"] else 0
    return {"context": ctx, "batch": batch, "budget": "full" if budget == FULL else budget,
            "kv": after["kv_cache_dtype"], **spread("step_ms", times),
            "bytes_loaded_per_step": loaded // steps, "bytes_gathered_per_step": gathered // steps,
            "prefill_s": round(prefill_s, 2)}


def spread(key: str, times: list[float]) -> dict:
    """{key_min, key, key_max} in ms: min, median and max of `times` (seconds)."""
    return {f"{key}_min": round(min(times) * 1e3, 2), key: round(percentile(times, 50) * 1e3, 2),
            f"{key}_max": round(max(times) * 1e3, 2)}


def run_mode(config: EngineConfig, cases, budgets, steps, kernel_sets,
             dense_graphs: str = "auto") -> list:
    with engine_core(config) as core:
        rows = []
        for i, (ctx, batch) in enumerate(cases):
            rows += one_case(core, ctx, batch, budgets, steps, i, kernel_sets or
                             [core.runner.decoder.kernels.name], dense_graphs)
        return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--skip", default="", help="resident and/or offload")
    parser.add_argument("--cases", default="", help="these CTXxBATCH cases instead, e.g. 4096x1,131072x1")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: SmolLM2's)")
    parser.add_argument("--budgets", default="", help="only these budgets, e.g. full,4096")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs (enforce_eager)")
    parser.add_argument("--kv-dtypes", default="auto",
                        help="KV cache dtypes to run in turn, e.g. auto,fp8_e4m3")
    parser.add_argument("--layer-kernels", default="",
                        help="decoder kernels to run in turn on each engine, e.g. reference,triton "
                             "(default: the engine's own choice)")
    parser.add_argument("--dense-graphs", default="auto",
                        help="offload Full: auto (the engine's rule: a chain of graphs) or never "
                             "(the eager ring), or both in turn: never,auto")
    parser.add_argument("--reuse-pages", action="store_true",
                        help="offload: keep selected pages on the device between steps")
    parser.add_argument("--name", default=None, help="results file name")
    args = parser.parse_args()
    kernel_sets = [k for k in args.layer_kernels.split(",") if k]
    smoke = args.smoke
    shape, max_pos = ("tiny", 4096) if smoke else ("qwen3-4b", 131072 + 1024)
    budgets = [FULL, 64, 128] if smoke else [FULL, 1024, 2048, 4096]
    if args.budgets:
        budgets = [FULL if b == "full" else int(b) for b in args.budgets.split(",")]
    # Page reuse's device buffers are planned from the policy the engine starts with: the
    # largest budget timed (set_budget changes it between runs).
    planned = max((b for b in budgets if b != FULL), default=FULL) if args.reuse_pages else FULL
    base = dict(model=str(shaped_model(shape, max_positions=max_pos)), load_format="dummy",
                tokenizer=args.tokenizer or smollm2(), device="cpu" if smoke else "cuda",
                dtype="float32" if smoke else "bfloat16", max_num_seqs=4, max_model_len=max_pos,
                sparse_policy=QuestPolicy(budget_tokens=planned, dense_layers=0 if smoke else 2,
                                          reuse_pages=args.reuse_pages),
                max_num_batched_tokens=16384, enforce_eager=args.eager)
    resident_cases = [(512, 1), (512, 2)] if smoke else [(32768, 1), (32768, 4), (131072, 1)]
    offload_cases = resident_cases if smoke else resident_cases + [(131072, 4)]
    if args.cases:
        resident_cases = offload_cases = [tuple(map(int, case.split("x"))) for case in args.cases.split(",")]
    steps = 3 if smoke else args.steps
    name = args.name or ("quest_speed_eager" if args.eager else "quest_speed")
    results = {"shape": shape, "steps_timed": steps, "resident": [], "offload": []}
    for kv in args.kv_dtypes.split(","):
        kv_base = {**base, "kv_cache_dtype": kv}
        if "resident" not in args.skip:
            # Page reuse is for offload (it raises without it): resident runs leave it off.
            resident = {**kv_base, "sparse_policy": dataclasses.replace(base["sparse_policy"],
                                                                        reuse_pages=False)}
            results["resident"] += run_mode(EngineConfig(**resident), resident_cases, budgets, steps,
                                           kernel_sets)
            save(name, results, smoke=smoke)
        if "offload" not in args.skip:
            block = 16 if smoke else 256
            pool = max(max_pos, *(c * b for c, b in offload_cases)) // block + 64
            cfg = EngineConfig(**{**kv_base, "offload": True, "num_kv_blocks": pool,
                                  **({"kv_block_size": 16, "offload_slot_tokens": 64} if smoke else {})})
            for dense in args.dense_graphs.split(","):
                results["offload"] += run_mode(cfg, offload_cases, budgets, steps, kernel_sets,
                                               dense)
            save(name, results, smoke=smoke)
    summarize(results)


def summarize(results: dict) -> None:
    """Ratios are to the resident Full step of the run's first KV dtype, same layer kernels,
    timed the same way (synchronous or pipelined)."""
    first = next((r["kv"] for r in results.get("resident", [])), None)
    resident = {(r["context"], r["batch"], r["layer_kernels"]): r
                for r in results.get("resident", []) if r["budget"] == "full" and r["kv"] == first}
    print(f"{'mode':<9}{'kernels':>10}{'kv':>14}{'ctx':>8}{'batch':>6}{'budget':>7}"
          f"{'sync ms (min/med/max)':>24}{'x Full':>8}{'pipelined ms':>24}{'x Full':>8}"
          f"{'loaded MB':>11}{'gathered MB':>12}{'graph':>7}{'dense':>8}")
    for mode in ("resident", "offload"):
        for r in results.get(mode, []):
            ref = resident.get((r["context"], r["batch"], r["layer_kernels"]))
            cells = ""
            for key in ("step_ms", "pipelined_step_ms"):
                ratio = f"{r[key] / ref[key]:.2f}" if ref and key in r and key in ref else "-"
                cells += f"{r.get(key + '_min')}/{r.get(key)}/{r.get(key + '_max')}".rjust(24)
                cells += ratio.rjust(8)
            print(f"{mode:<9}{r['layer_kernels']:>10}{r['kv']:>14}{r['context']:>8}{r['batch']:>6}"
                  f"{str(r['budget']):>7}{cells}"
                  f"{r['bytes_loaded_per_step'] / 1e6:>11.1f}{r['bytes_gathered_per_step'] / 1e6:>12.1f}"
                  f"{r.get('graph_steps', 0):>7}{r.get('dense_graphs', '-'):>8}")


if __name__ == "__main__":
    main()
