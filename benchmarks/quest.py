"""Quest, sparse decode: the engine's step, its kernels, and how its page picks move.

    python benchmarks/run.py quest --section SECTION [options]      # --smoke: CPU, tiny shapes

Sections (the section's own options after its name; defaults in brackets):

- `speed` [default]: decode steps against Full, resident and offloaded, one engine per mode.
  Qwen3-4B shape, random weights, bf16. For each (context, batch) case the prompts are
  prefilled once; then every budget (Full, 1K, 2K, 4K tokens) decodes the same sequences in
  turn: the engine's Quest runtime is given the budget (Full = a budget no context reaches,
  which takes the dense path) and, resident, the CUDA graphs are captured again. Steps are
  timed two ways: `step_ms`, synchronously (EngineCore.step with the device synchronized,
  so a step is its whole latency, host work included), and `pipelined_step_ms`, as the
  engine's stages run them (the next step is scheduled, prepared and launched before the
  previous one's tokens are read back, so host work hides behind the device): the interval
  between consecutive steps' results. With offload, bytes moved per step: ring loads (Full)
  or gathered pages (with --reuse-pages, only the pages a row's slots did not already hold).
  `graph_pool_mib`: the device memory each capture reserved (its graphs' private pool).
  --steps [10] timed steps of each kind a run; --cases CTXxBATCH,...; --budgets full,4096;
  --kv-dtypes auto,fp8_e4m3 (in turn); --gqa-reduce max,relative (in turn, each budget);
  --skip resident|offload|offload_full; --layer-kernels
  reference,triton (in turn); --dense-graphs auto|never (offload Full: a chain of graphs,
  or the eager ring); --reuse-pages; --prefetch 0,1.5 (offload: Quest's prefetch values, in
  turn for each budget; `late_bytes_per_step` is what the layers still gathered themselves);
  --late-fetch on,off (offload: Quest's `late_fetch` in turn for each prefetch value but 0,
  which always fetches; off reads the predicted pages only, and nothing loads in a layer's
  path);
  --keys-on-device (offload: Quest's `keys_on_device`, the selecting layers' keys kept on the
  device, so the gathered bytes, which count only what crosses PCIe, are the values');
  --eager (no CUDA graphs); --tokenizer DIR.
- `kernels`: the decode kernels against their torch references, then timings. bf16, the
  Qwen3-4B/8B attention shape (8 KV heads, 4 query heads each, head_dim 128), page 16, KV
  block 16. Per (batch, context, budget): the share of the fused selection's pages that the
  torch reference did not pick (near-ties only), the error of the selected-pages decode
  (vs torch in fp32), and the times of the selection (fused and torch), the selected decode,
  the whole Quest step and dense decode (CUDA events, --reps [50] calls a run). Also: bounds
  maintenance exact, all-pages selection == dense decode, a CUDA-graph replay of the Quest
  step, and the page gather from a pinned host pool (zero-copy) and from device memory, in
  GB/s. Error = max|x - ref| / max|ref|; a row with an error >= 1e-2 or a failed check fails
  the run (exit 1).
- `kernel_sweep`: the page-scores kernel by pages per program and warps, and attention over
  the selected pages by split count ("auto": the engine's launch), each checked against the
  engine's launch (`same`, `err`). --contexts [32768,131072] --batches [1,4] --budget [4096]
  --reps [20].
- `layouts`: the page-scores kernel per layout of the bounds in memory, each call on another
  copy (the bounds come from HBM, as a step's layers read them), at the engine's tile.
- `select_sweep`: the page selection (scores plus picks) per warp count of the select
  kernel, and with half the register head it picks (the rest of the row re-read from L2 on
  every step); `same_pages` against the first variant. --contexts
  [32768,99840,131072,199936] (whole blocks; 99,840 and 199,936 tokens are rows between
  two powers of two) --batches [1,4] --budget [4096] --reps [20].
  kernel_sweep, layouts and select_sweep: a Qwen3-4B-shaped layer (8 KV heads, 4 query
  heads each, head dim 128, bf16 bounds, KV block 256), each call replayed from a CUDA
  graph of 20 calls, so a figure is GPU time, in us per call (one value per replay). Without
  CUDA they time the torch reference of the op once per case (variant "reference"), which
  checks the section's inputs and nothing of the kernels' speed.
- `locality`: how much of the page selection carries over from one decode step to the next.
  With offload every page a step selects crosses PCIe, even one the previous step read too;
  this measures what a device-side cache of last step's pages could save: per decode step
  after the first, per layer and KV head, the share of the selected pages that the same
  layer and head selected one step before (sink and recent pages included, as a step
  gathers them). `carried_over` has one value per step; `carried_over_mean` is their mean.
  One sequence, greedy, resident and eager. A real model (--model FILE) reads a natural-text
  prompt (filler sentences, then a question about them); a shape name (--model qwen3-4b;
  --smoke: tiny) reads random tokens. --ctx [16384] (a list) --budgets [1024,2048,4096] --steps [48]
  --tokenizer DIR.
- `profile`: where a Quest decode step's time goes: the torch profiler over 4 synchronous
  steps, its tables printed; `step_ms` of those steps. Qwen3-4B shape. --ctx [32768]
  --budget [2048] --offload --eager --tokenizer DIR.
- `reuse`: on a real model with offload, decode steps without and with `reuse_pages`
  (figures `..._off` and `..._on`). A random-weight shape picks pages with little overlap
  from one step to the next; a real model reading natural text keeps most of them
  (`locality`). Each run builds a fresh engine per variant, prefills, then times decode
  steps (synchronous and pipelined, as `speed`) and counts the pages read and loaded per
  step; the two variants alternate within a run, so each repeat measures both on the same
  machine state. --model FILE --ctx [32000] --budget [4096] --steps [32]; use --repeats 3.
  (--smoke without --model: the tiny shape, random weights, SmolLM2's tokenizer.)

- `prefetch`: Quest's prefetch changes what loads when, never what a step reads: per
  --prefetch value (0 first), a fresh offloaded engine, CUDA graphs as the engine decides,
  generates --steps greedy tokens for the same random prompts (--cases CTXxBATCH, Qwen3-4B
  shape; --smoke: tiny) at --budget; on the CPU (float32) a row fails unless its tokens
  equal prefetch 0's; in bf16 on a GPU, where random weights' logits nearly tie and pages
  read in slot order round differently, the agreement is reported only. Also
  the pages read, loaded a layer early and loaded late per step. --kv-dtypes (in turn).

- `filled`: decode steps over a context too long to prefill in a benchmark (a million tokens),
  written straight into the host pool (kv_fill.py: random K/V, Quest's page and group
  bounds as prefill computes them, the blocks published as a cached prefix). Offload, one
  engine per (kv dtype, case) that sizes itself from max_model_len = the case's context;
  the prompt is the context less one block, whose prefill is the first step (it reads the
  whole context through the ring); then each budget and --groups setting decodes in turn,
  timed as `speed` does. Info: the memory plan (`plan`, `plan_host_gib`,
  `plan_device_gib`), what was measured (`host_pinned_gib`, `pool_pieces`, `pool_alloc_s`:
  allocating and pinning the pool, `device_used_gib`, `device_allocated_gib`), `engine_s`,
  `fill_s`, and `pages_per_selection` (a row fails unless it is the budget's pages).
  --cases [1048576x1] --kv-dtypes [fp8_e4m3] --budgets [4096] --groups [auto] (auto: the
  policy's rule; on, off, or several in turn) --shape [qwen3-4b] --steps [10]
  --keys-on-device (as in `speed`); --smoke:
  the tiny shape, 64-token blocks, groups of 4 pages, contexts 2048x1,1024x2.

- `agreement`: two runs that must give the same greedy tokens at long contexts, random weights
  (--shape [qwen3-4b]; --smoke: tiny), prompts of random ids (common.synthetic_tokenizer
  unless --tokenizer: a device command carries nothing). --checks [covering,offload]:
  - `covering`: offloaded Quest at a budget that covers the context against offloaded Full,
    in one engine over one context written into the host pool as `filled` writes it (--ctx
    [1048576], --kv-dtypes [fp8_e4m3], --groups [auto]; the budget is the context). Full runs
    first (a budget no context reaches: every offloaded layer's context through the ring;
    Quest's dense layers keep theirs on the device in both runs), then Quest,
    told to select from the first decode step (set_budget's select_above: a budget that
    covers the context would otherwise be read densely), so every page is picked and gathered
    from the host pool. Both prefill the prompt's last block alike. The row fails unless
    every selection of every sparse layer read every host page of its context (`every_page`,
    the engine's Quest counters) and the Full run selected none (`full_dense`).
  - `offload`: Full attention resident (the reference) against offloaded, one engine each,
    the same random prompt prefilled in both (--ctx [65536], --kv-dtypes [auto]). Dummy weights
    come from a generator seeded alike, so two engines on one device hold the same ones
    (`same_weights` compares sums of three of them; the row fails without).
  Each run generates --steps [16] greedy tokens (the first from the prefill) with their top-2
  logprobs. Figures: `identical_tokens` before the runs part, `logprob_drift` (the largest
  difference of a token's logprob before that: how far rounding moved the runs apart), and
  each run's seconds. Info: both runs' tokens and, where they part, the step and the top-2
  margins there (`margin`, the reference's; `compared_margin`). In float32 (the CPU's, or
  --dtype float32 for `offload` on CUDA) a row fails at any parting or a drift beyond 1e-4;
  in bf16, where random weights' logits nearly
  tie, only at a parting whose reference margin is beyond --tie [0.25] nats. --eager; --smoke:
  contexts 2048 (covering) and 1024 (offload), 6 tokens.

A run of `speed` with --repeats 1 reports min / median / max of its --steps steps, as one
run of the engine.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import math
import random
import statistics
import time
from contextlib import contextmanager
from functools import partial
from typing import Iterator

import torch

from common import (agreement, cuda_times_ms, engine_core, run_requests, shaped_model,  # noqa: I001
                    smollm2, synthetic_tokenizer, top2_margins)
from astream.base.config import EngineConfig
from astream.base.outputs import StreamToken
from astream.base.sampling import SamplingParams
from astream.core.engine_core import EngineCore
from astream.policies import QuestPolicy

SECTIONS = ("speed", "kernels", "kernel_sweep", "layouts", "select_sweep", "locality", "profile",
            "reuse", "filled", "prefetch", "agreement")
FULL = 1 << 40                                   # a budget no context reaches: the dense path
KV_HEADS, GROUP, DIM, PAGE = 8, 4, 128, 16       # the Qwen3-4B/8B attention shape, Quest's page
KERNEL_BLOCK, HOST_BLOCK = 16, 256               # `kernels`: KV block; gather's host pool block
SWEEP_BLOCK = 256                                # the sweeps: KV block, as the engine's at 128K
ERR_LIMIT = 1e-2
# `agreement`, bf16: runs that sum in another order part where random weights' top two logits
# are a bf16 step or two apart (0.0625 and 0.125 seen) and, between TP sizes, up to 0.19
# (tensor_parallel.py's check, which allows the same): a parting within it is rounding.
TIE = 0.25
EXACT_DRIFT = 1e-4               # float32: a logprob two exact runs may differ by (rounding)

# Defaults that differ by section (None in the parser).
DEFAULTS = {
    "speed": dict(steps=10, kv_dtypes="auto"),
    "kernels": dict(reps=50),
    "kernel_sweep": dict(contexts="32768,131072", batches="1,4", budget=4096, reps=20),
    "layouts": dict(contexts="32768,131072", batches="1,4", budget=4096, reps=20),
    "select_sweep": dict(contexts="32768,99840,131072,199936", batches="1,4", budget=4096,
                         reps=20),
    "locality": dict(ctx="16384", budgets="1024,2048,4096", steps=48),
    "profile": dict(ctx="32768", budget=2048),
    "reuse": dict(ctx="32000", budget=4096, steps=32),
    "filled": dict(steps=10, kv_dtypes="fp8_e4m3", cases="1048576x1", budgets="4096",
                   shape="qwen3-4b"),
    "prefetch": dict(steps=24, kv_dtypes="auto", cases="32768x2", budget=2048),
    "agreement": dict(steps=16, checks="covering,offload", shape="qwen3-4b"),
}
SMOKE = {
    "speed": dict(steps=3, kv_dtypes="auto"),
    "kernels": dict(reps=3),
    "kernel_sweep": dict(contexts="512", batches="1,2", budget=128, reps=3),
    "layouts": dict(contexts="512", batches="2", budget=128, reps=3),
    "select_sweep": dict(contexts="512,1280", batches="2", budget=128, reps=3),
    "locality": dict(ctx="600", budgets="128", steps=6),
    "profile": dict(ctx="256", budget=64),
    "reuse": dict(ctx="600", budget=64, steps=4),
    "filled": dict(steps=3, kv_dtypes="fp8_e4m3", cases="2048x1,1024x2", budgets="128",
                   shape="tiny"),
    "prefetch": dict(steps=6, kv_dtypes="auto", cases="600x2", budget=64),
    "agreement": dict(steps=6, checks="covering,offload", shape="tiny"),
}


def add_arguments(parser) -> None:
    parser.add_argument("--section", default="speed", choices=SECTIONS)
    parser.add_argument("--steps", type=int, default=None, help="decode steps timed a run")
    parser.add_argument("--cases", default=None,
                        help="speed, filled: CTXxBATCH cases, e.g. 4096x1,131072x1")
    parser.add_argument("--tokenizer", default=None,
                        help="a tokenizer folder (default: common.synthetic_tokenizer(); random weights only)")
    parser.add_argument("--budgets", default=None, help="speed: e.g. full,4096; locality: 1024,2048")
    parser.add_argument("--budget", type=int, default=None, help="one budget, tokens")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs (enforce_eager)")
    parser.add_argument("--kv-dtypes", default=None,
                        help="speed, filled, agreement: KV dtypes in turn, e.g. auto,fp8_e4m3")
    parser.add_argument("--layer-kernels", default="",
                        help="speed: decoder kernels in turn, e.g. reference,triton "
                             "(default: the engine's own choice)")
    parser.add_argument("--dense-graphs", default="auto",
                        help="speed, offload Full: auto (a chain of graphs) or never (the eager "
                             "ring), or both in turn: never,auto")
    parser.add_argument("--skip", default="",
                        help="speed: resident, offload and/or offload_full (its Full rows)")
    parser.add_argument("--reuse-pages", action="store_true",
                        help="speed, offload: keep selected pages on the device between steps")
    parser.add_argument("--gqa-reduce", default=QuestPolicy().gqa_reduce,
                        help="speed: Quest's GQA reductions in turn, e.g. max,relative; "
                             "kernels, filled, agreement: the first "
                             f"[the policy's default, {QuestPolicy().gqa_reduce}]")
    parser.add_argument("--prefetch", default="0",
                        help="speed, offload: Quest prefetch values in turn, e.g. 0,1,1.5")
    parser.add_argument("--late-fetch", default="on",
                        help="speed, offload, with --prefetch: Quest's late_fetch in turn, e.g. "
                             "on,off (off: layers read the predicted pages only)")
    parser.add_argument("--keys-on-device", action="store_true",
                        help="speed, filled: offloaded engines keep the selecting layers' keys on "
                             "the device (QuestPolicy keys_on_device)")
    parser.add_argument("--offload", action="store_true", help="profile: offload the KV cache")
    parser.add_argument("--reps", type=int, default=None, help="timed calls of a kernel a run")
    parser.add_argument("--contexts", default=None, help="the kernel sections' contexts")
    parser.add_argument("--batches", default=None, help="the kernel sections' batch sizes")
    parser.add_argument("--ctx", default=None,
                        help="locality, profile, reuse, agreement: context tokens")
    parser.add_argument("--model", default=None,
                        help="locality, reuse: a GGUF file or model folder, or a shape name")
    parser.add_argument("--shape", default=None,
                        help="filled, agreement: a model shape (common.SHAPES)")
    parser.add_argument("--groups", default="auto",
                        help="filled, agreement: Quest's two-level selection auto (the policy's "
                             "rule), on or off, or several in turn: off,on")
    parser.add_argument("--checks", default=None,
                        help="agreement: covering (Quest at a covering budget against Full, "
                             "offloaded) and/or offload (offloaded Full against resident)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="agreement, offload: the model's dtype (auto: float32 on the CPU, "
                             "bfloat16 on CUDA); float32 holds the runs to float32's limits")
    parser.add_argument("--tie", type=float, default=TIE,
                        help=f"agreement, bf16: the reference's top-2 logprob margin two runs may "
                             f"part at [{TIE}]")


def cases(options) -> Iterator[tuple[dict, object]]:
    for key, value in (SMOKE if options.smoke else DEFAULTS).get(options.section, {}).items():
        if getattr(options, key) is None:
            setattr(options, key, value)
    return SECTION_CASES[options.section](options)


# ---------------------------------------------------------------- the engine's decode step

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


def set_budget(core: EngineCore, budget: int, kernels: str, dense_graphs: str = "auto",
               select_above: int | None = None, **policy) -> int:
    """The engine's Quest runtime given `budget` (and other `policy` fields), its graphs
    captured again. Decode selects pages once a context passes `select_above` tokens (None:
    the budget, as the policy binds; a budget that covers the context then reads it densely).
    Returns the device bytes the capture reserved (0 on the CPU)."""
    from astream.executor.build import build_graphs
    from astream.ops.layer_kernels import LayerKernels
    runtime = core.runner.policy
    runtime.policy = quest = dataclasses.replace(runtime.policy, budget_tokens=budget, **policy)
    # Page buffers exist where the engine started with them; a run without turns them off.
    buffered = runtime.reuse is not None and quest.buffer_pages > 0
    runtime.traits = dataclasses.replace(
        runtime.traits, select_above=budget if select_above is None else select_above,
        loads_pages=buffered, prefetches=buffered and quest.prefetch > 0)
    core.runner.decoder.kernels = LayerKernels(kernels)
    # Graphs bake the selection and the kernels in: capture again. --eager keeps every step eager.
    core.runner.graphs = None
    gc.collect()
    cuda = core.runtime.device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()        # the previous capture's pool, so the next one is counted
    reserved = torch.cuda.memory_reserved() if cuda else 0
    core.runner.graphs = graphs = build_graphs(core.config, core.plan, core.runner)
    captured = torch.cuda.memory_reserved() - reserved if cuda else 0
    # With offload, a policy that never selects (Full) loads whole contexts between a chain of
    # graphs; "never" measures the eager ring instead.
    if graphs is not None and getattr(graphs, "dense", False) and dense_graphs == "never":
        core.runner.graphs = None
    return captured


def model_dtype(o) -> str:
    """The engines' model dtype: float32 on the CPU (exact comparisons), bf16 on CUDA."""
    return "float32" if o.device == "cpu" else "bfloat16"


def ms(times: list[float]) -> list[float]:
    return [round(t * 1e3, 3) for t in times]


def keeps_device_keys(core: EngineCore) -> bool:
    """Whether the engine's offloaded layers gather keys from a device copy (keys_on_device)."""
    offload = core.runner.offload
    return offload is not None and any(k is not None for k in offload.device_k)


def page_bytes(core: EngineCore) -> int:
    """One KV head's Quest page over PCIe, in the cache's dtype: K and V, or only V where
    the device keeps the keys (keys_on_device)."""
    dtype = getattr(torch, core.stats()["kv_cache_dtype"])
    parts = 1 if keeps_device_keys(core) else 2
    return core.runner.policy.policy.page_size * core.model.decoder.config.head_dim * parts * dtype.itemsize


def pages_crossed(before: dict, after: dict) -> tuple[int, int, int]:
    """Quest's host pages that crossed PCIe between two `EngineCore.stats()`: (all of them,
    those the layers loaded in their own path, those that went through page buffers).
    Through page buffers (a prefetch's, or reuse_pages') only the pages that loaded cross;
    otherwise every page read does, in the layer's path."""
    def pages(counter: str) -> int:
        return sum(after.get(counter, [0])) - sum(before.get(counter, [0]))

    buffered = pages("quest_pages_loaded")
    if buffered:
        return buffered, pages("quest_pages_loaded_late"), buffered
    read = pages("quest_pages_read")
    return read, read, 0


def measure_steps(core: EngineCore, steps: int, prefill_s: float, graph_bytes: int = 0) -> dict:
    before = core.stats()
    times = decode_steps(core, steps)
    after = core.stats()
    pipelined = pipelined_steps(core, steps + 1)
    loaded = after.get("offload_bytes_loaded", 0) - before.get("offload_bytes_loaded", 0)
    gathered = late = 0
    if after["offload"]:
        crossed, in_path, _ = pages_crossed(before, after)
        size = page_bytes(core)
        gathered, late = crossed * size, in_path * size
    return {"step_ms": ms(times), "pipelined_step_ms": ms(pipelined),
            "bytes_loaded_per_step": loaded // steps, "bytes_gathered_per_step": gathered // steps,
            "late_bytes_per_step": late // steps,
            "info": {"graph_steps": after["graph_steps"] - before["graph_steps"],
                     "prefill_s": round(prefill_s, 2),
                     "graph_pool_mib": round(graph_bytes / 2**20, 1)}}


def engine_speed_cases(config: EngineConfig, mode: str, shapes, budgets, steps: int,
                       kernel_sets: list[str], dense_graphs: str, prefetches: tuple[float, ...] = (0,),
                       reductions: tuple[str, ...] = (QuestPolicy().gqa_reduce,),
                       late_fetches: tuple[bool, ...] = (True,)):
    with engine_core(config) as core:
        kv = core.stats()["kv_cache_dtype"]
        params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
        for seed, (ctx, batch) in enumerate(shapes):
            gen = torch.Generator().manual_seed(seed)
            ids = [f"c{seed}-{i}" for i in range(batch)]
            sinks = [core.add_request(rid, torch.randint(100, 49152, (ctx,), generator=gen).tolist(),
                                      params) for rid in ids]
            start = time.perf_counter()
            while not all(sink.tokens for sink in sinks):
                core.step()
            core.runtime.synchronize()
            prefill_s = time.perf_counter() - start
            for kernels in kernel_sets or [core.runner.decoder.kernels.name]:
                for budget in budgets:
                    sparse = budget != FULL
                    variants = [(prefetch, reduce, late_fetch) for prefetch, reduce in
                                itertools.product(prefetches if sparse else (0,),
                                                  reductions if sparse else ("-",))
                                # Without a prefetch there is no prediction to read instead.
                                for late_fetch in (late_fetches if prefetch else (True,))]
                    for prefetch, reduce, late_fetch in variants:
                        graph_bytes = set_budget(
                            core, budget, kernels, dense_graphs, prefetch=prefetch,
                            late_fetch=late_fetch, **({"gqa_reduce": reduce} if sparse else {}))
                        decode_steps(core, 2)                    # warm-up (and Triton compiles)
                        yield ({"mode": mode, "kv": kv, "context": ctx, "batch": batch,
                                "budget": "full" if budget == FULL else budget,
                                "prefetch": prefetch, "late_fetch": late_fetch,
                                "gqa_reduce": reduce,
                                "keys_on_device": keeps_device_keys(core),
                                "layer_kernels": kernels,
                                "dense_graphs": dense_graphs},
                               partial(measure_steps, core, steps, prefill_s, graph_bytes))
            for rid in ids:
                core.abort(rid)


def speed_cases(o):
    smoke = o.smoke
    shape, max_pos = ("tiny", 4096) if smoke else ("qwen3-4b", 131072 + 1024)
    budgets = [FULL, 64, 128] if smoke else [FULL, 1024, 2048, 4096]
    if o.budgets:
        budgets = [FULL if b == "full" else int(b) for b in o.budgets.split(",")]
    kernel_sets = [k for k in o.layer_kernels.split(",") if k]
    # Page reuse's device buffers and the selection's scratch are planned from the policy the
    # engine starts with: the largest budget timed, "relative" if timed (set_budget changes
    # them between runs).
    prefetches = tuple(float(p) for p in o.prefetch.split(","))
    reductions = tuple(o.gqa_reduce.split(","))
    late_fetches = tuple({"on": True, "off": False}[v] for v in o.late_fetch.split(","))
    planned = max((b for b in budgets if b != FULL), default=FULL)
    base = dict(model=str(shaped_model(shape, max_positions=max_pos)), load_format="dummy",
                tokenizer=o.tokenizer or synthetic_tokenizer(), device=o.device,
                dtype=model_dtype(o), max_num_seqs=4,
                max_model_len=max_pos,
                sparse_policy=QuestPolicy(budget_tokens=planned, dense_layers=0 if smoke else 2,
                                          reuse_pages=o.reuse_pages, prefetch=max(prefetches),
                                          keys_on_device=o.keys_on_device,
                                          gqa_reduce="relative" if "relative" in reductions
                                          else reductions[0]),
                max_num_batched_tokens=16384, enforce_eager=o.eager)
    resident_cases = [(512, 1), (512, 2)] if smoke else [(32768, 1), (32768, 4), (131072, 1)]
    offload_cases = resident_cases if smoke else resident_cases + [(131072, 4)]
    if o.cases:
        resident_cases = offload_cases = parse_cases(o.cases)
    for kv in o.kv_dtypes.split(","):
        kv_base = {**base, "kv_cache_dtype": kv}
        skip = set(o.skip.split(","))
        if "resident" not in skip:
            # Page reuse is for offload (it raises without it): resident runs leave it off.
            resident = {**kv_base, "sparse_policy": dataclasses.replace(
                base["sparse_policy"], reuse_pages=False, prefetch=0, keys_on_device=False)}
            yield from engine_speed_cases(EngineConfig(**resident), "resident", resident_cases,
                                          budgets, o.steps, kernel_sets, "auto",
                                          reductions=reductions)
        if "offload" not in skip:
            block = 16 if smoke else 256
            pool = max(max_pos, *(c * b for c, b in offload_cases)) // block + 64
            cfg = EngineConfig(**{**kv_base, "offload": True, "num_kv_blocks": pool,
                                  **({"kv_block_size": 16, "offload_slot_tokens": 64} if smoke else {})})
            offload_budgets = [b for b in budgets if b != FULL or "offload_full" not in skip]
            for dense in o.dense_graphs.split(","):
                yield from engine_speed_cases(cfg, "offload", offload_cases, offload_budgets, o.steps,
                                              kernel_sets, dense, prefetches, reductions,
                                              late_fetches)


def summarize(result: dict) -> None:
    """`speed`: each row's medians as a ratio to the resident Full step of the run's first KV
    dtype, same layer kernels, timed the same way (synchronous or pipelined)."""
    if result["options"].get("section") != "speed":
        return
    rows = result["rows"]
    first = next((r["params"]["kv"] for r in rows if r["params"]["mode"] == "resident"), None)
    full = {(r["params"]["context"], r["params"]["batch"], r["params"]["layer_kernels"]): r
            for r in rows if r["params"]["mode"] == "resident" and r["params"]["budget"] == "full"
            and r["params"]["kv"] == first}
    print(f"\nmedian ms and x resident Full ({first})")
    print(f"{'mode':<9}{'kernels':>10}{'kv':>14}{'ctx':>8}{'batch':>6}{'budget':>7}{'ahead':>7}{'gqa':>9}"
          f"{'sync':>10}{'x Full':>8}{'pipelined':>11}{'x Full':>8}{'late MB':>9}")
    for r in rows:
        p, f = r["params"], r["figures"]
        ref = full.get((p["context"], p["batch"], p["layer_kernels"]))
        cells = ""
        for key, width in (("step_ms", 10), ("pipelined_step_ms", 11)):
            median = f[key]["median"]
            ratio = f"{median / ref['figures'][key]['median']:.2f}" if ref else "-"
            cells += f"{median:>{width}.2f}{ratio:>8}"
        late = f.get("late_bytes_per_step", {}).get("median", 0) / 1e6
        print(f"{p['mode']:<9}{p['layer_kernels']:>10}{p['kv']:>14}{p['context']:>8}"
              f"{p['batch']:>6}{str(p['budget']):>7}"
              f"{str(p.get('prefetch', 0)) + ('' if p.get('late_fetch', True) else '*'):>7}"
              f"{p.get('gqa_reduce', '-'):>9}{cells}{late:>9.1f}")
    print("ahead: Quest's prefetch (x the budget); *: with late_fetch off (the predicted pages only)")


# ---------------------------------------------------------------- kernels, against torch

def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.float(), ref.float()
    ok = torch.isfinite(ref)
    if not torch.equal(ok, torch.isfinite(x)):
        return 1.0
    return ((x - ref)[ok].abs().max() / ref[ok].abs().max().clamp_min(1e-6)).item()


def times_us(fn, reps: int) -> list[float]:
    """Microseconds of each of `reps` calls after warm-up: CUDA events recorded back to back
    on a GPU, wall time of each call elsewhere."""
    for _ in range(3):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for begin, end in events:
        begin.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [b.elapsed_time(e) * 1e3 for b, e in events]


def make_case(batch: int, ctx: int, dev: str, gen: torch.Generator, gqa_reduce: str) -> dict:
    """Shuffled paged bf16 caches of `batch` sequences of `ctx` tokens, and their bounds;
    selections over them reduce a group's query heads by `gqa_reduce`."""
    from astream.ops import quest
    from astream.ops.quest_select import physical_page_ids
    per_seq = -(-ctx // KERNEL_BLOCK)
    shape = (batch * per_seq, KERNEL_BLOCK, KV_HEADS, DIM)
    k = torch.randn(shape, device=dev, generator=gen).bfloat16()
    v = torch.randn(shape, device=dev, generator=gen).bfloat16()
    tables = torch.randperm(batch * per_seq, device=dev, generator=gen).view(batch, -1).int()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    kmin, kmax = quest.allocate_page_bounds(shape[0], KERNEL_BLOCK, KV_HEADS, DIM, dtype=k.dtype,
                                            device=dev)
    quest.store_block_bounds(kmin, kmax, k, torch.arange(shape[0], device=dev))
    ids, num = physical_page_ids(tables, lens, max_pages=per_seq * KERNEL_BLOCK // PAGE,
                                 block_size=KERNEL_BLOCK)
    q = torch.randn(batch, KV_HEADS * GROUP, DIM, device=dev, generator=gen).bfloat16()
    return dict(q=q, k=k, v=v, tables=tables, lens=lens, kmin=kmin, kmax=kmax, ids=ids, num=num,
                gqa_reduce=gqa_reduce)


def select(c: dict, budget: int, fn=None):
    from astream.ops.quest_select import select_decode_pages
    return (fn or select_decode_pages)(
        c["q"], c["kmin"], c["kmax"], c["tables"], c["lens"], max_pages=c["ids"].shape[1],
        block_size=KERNEL_BLOCK, page_size=PAGE, budget_pages=budget, gqa_reduce=c["gqa_reduce"])


def quest_step(c: dict, budget: int):
    """Selection -> selected decode: one layer's Quest decode."""
    from astream.ops import pages as page_ops
    pages, counts, _ = select(c, budget)
    return page_ops.paged_decode_selected(c["q"], c["k"], c["v"], c["tables"], pages, counts,
                                       c["lens"], page_size=PAGE, scale=DIM ** -0.5)


def dense_decode(c: dict, max_ctx: int):
    from astream.ops.backends import AttentionBackends
    backends = AttentionBackends.select(c["q"].device, c["q"].dtype, DIM)
    return backends.paged_decode(c["q"], c["k"], c["v"], c["tables"], c["lens"],
                                 scale=DIM ** -0.5, max_context_len=max_ctx)


def mismatch(got, want) -> float:
    """Share of picked pages one selection has and the other has not."""
    differ = total = 0
    for b, h in ((b, h) for b in range(got.counts.shape[0]) for h in range(got.counts.shape[1])):
        n = int(got.counts[b, h])
        mine, theirs = set(got.indices[b, h, :n].tolist()), set(want.indices[b, h, :n].tolist())
        differ, total = differ + len(mine - theirs), total + n
    return differ / max(total, 1)


def decode_row(c: dict, budget: int, reps: int) -> dict:
    from astream.ops import pages as page_ops
    from astream.ops.quest_select import select_decode_pages_ref
    q = c["q"]
    chosen = select(c, budget)
    args = (q, c["k"], c["v"], c["tables"], chosen.indices, chosen.counts, c["lens"])
    kw = dict(page_size=PAGE, scale=DIM ** -0.5)
    out, lse = page_ops.paged_decode_selected(*args, **kw)
    ref_out, ref_lse = page_ops.paged_decode_selected_ref(q.float(), *args[1:], **kw)
    max_ctx = c["ids"].shape[1] * PAGE
    errors = {"select_mismatch": mismatch(chosen, select(c, budget, select_decode_pages_ref)),
              "err_out": rel_err(out, ref_out), "err_lse": rel_err(lse, ref_lse)}
    return {**errors, "ok": max(errors.values()) < ERR_LIMIT,
            "select_us": times_us(lambda: select(c, budget), reps),
            "select_ref_us": times_us(lambda: select(c, budget, select_decode_pages_ref), reps),
            "selected_us": times_us(lambda: page_ops.paged_decode_selected(*args, **kw), reps),
            "step_us": times_us(lambda: quest_step(c, budget), reps),
            "dense_us": times_us(lambda: dense_decode(c, max_ctx), reps)}


def all_pages_row(c: dict) -> dict:
    """A budget covering the context: the Quest step must equal dense decode."""
    n_pages = c["ids"].shape[1]
    out, lse = quest_step(c, n_pages)
    ref = dense_decode(c, n_pages * PAGE)
    err = max(rel_err(out, ref[0]), rel_err(lse, ref[1]))
    return {"err": err, "ok": err < ERR_LIMIT}


def bounds_row(dev: str, gen: torch.Generator) -> dict:
    """Prefill in chunks then decode tokens through update_page_bounds == whole-block bounds."""
    from astream.ops import quest
    blocks, n_tok = 64, 64 * KERNEL_BLOCK - 5
    keys = torch.randn(blocks * KERNEL_BLOCK, KV_HEADS, DIM, device=dev, generator=gen).bfloat16()
    kmin, kmax = quest.allocate_page_bounds(blocks, KERNEL_BLOCK, KV_HEADS, DIM, dtype=keys.dtype,
                                            device=dev)
    slots = torch.randperm(blocks, device=dev, generator=gen).repeat_interleave(KERNEL_BLOCK) \
        * KERNEL_BLOCK + torch.arange(KERNEL_BLOCK, device=dev).repeat(blocks)
    for lo, hi in ((0, 300), (300, n_tok - 40)):
        quest.update_page_bounds(kmin, kmax, keys[lo:hi], slots[lo:hi])
    for t in range(n_tok - 40, n_tok):
        quest.update_page_bounds(kmin, kmax, keys[t:t + 1], slots[t:t + 1])
    cache = torch.zeros(blocks * KERNEL_BLOCK, KV_HEADS, DIM, device=dev, dtype=keys.dtype)
    cache[slots[:n_tok]] = keys[:n_tok]
    valid = torch.zeros(blocks * KERNEL_BLOCK, dtype=torch.int64, device=dev)
    valid[slots[:n_tok]] = 1
    per_block = valid.view(blocks, KERNEL_BLOCK).sum(1)
    lo, hi = quest.bounds_of_blocks(cache.view(blocks, KERNEL_BLOCK, KV_HEADS, DIM), PAGE, per_block)
    exact = bool(torch.equal(lo, kmin) and torch.equal(hi, kmax))
    return {"exact": exact, "ok": exact}


def graph_row(c: dict, budget: int) -> dict:
    """Capture the Quest step in a CUDA graph, shorten the contexts, replay, compare."""
    quest_step(c, budget)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = quest_step(c, budget)
    new_lens = (c["lens"] // 3 + torch.arange(len(c["lens"]), device="cuda")).int()
    c["lens"].copy_(new_lens)
    c["num"].copy_((new_lens + PAGE - 1) // PAGE)
    graph.replay()
    ref_out, ref_lse = quest_step(c, budget)
    err = max(rel_err(out, ref_out), rel_err(lse, ref_lse))
    return {"err": err, "ok": err < ERR_LIMIT}


def gather_cases(batch: int, budgets: list[int], host_blocks: int, reps: int, dev: str,
                 gen: torch.Generator):
    """Zero-copy page gather from a pinned head-major host pool, and from device memory."""
    from astream.ops import pages as page_ops
    from astream.runtime.pinned import PinnedHostTensor
    shape = (2, host_blocks, KV_HEADS, HOST_BLOCK, DIM)
    pool = PinnedHostTensor(shape, torch.bfloat16, pin=dev == "cuda")
    try:
        pool.tensor.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(0)))
        sources = {"pinned_host": pool.tensor, "device": pool.tensor.to(dev)}
        for budget in budgets:
            n_pages = host_blocks * HOST_BLOCK // PAGE
            page_src = torch.randint(0, n_pages, (batch, KV_HEADS, budget), device=dev, generator=gen)
            counts = torch.full((batch, KV_HEADS), budget, dtype=torch.int32, device=dev)
            dst = torch.empty(2, batch, KV_HEADS, budget * PAGE, DIM, dtype=torch.bfloat16, device=dev)
            want = torch.empty_like(dst)
            page_ops.gather_pages_ref(sources["device"][0], sources["device"][1], page_src, *want, counts)
            for where, src in sources.items():
                yield ({"part": "gather", "source": where, "batch": batch, "budget_pages": budget},
                       partial(gather_row, src, page_src, dst, want, counts, reps))
    finally:
        pool.release()


def gather_row(src, page_src, dst, want, counts, reps: int) -> dict:
    from astream.ops import pages as page_ops

    def run():
        page_ops.gather_pages(src[0], src[1], page_src, *dst, counts)
    try:
        dst.zero_()
        run()
        us = times_us(run, reps)
    except Exception as exc:  # e.g. Triton refusing a host pointer: report, go on
        return {"exact": False, "ok": False, "error": repr(exc)}
    exact = bool(torch.equal(dst, want))
    nbytes = dst.numel() * dst.element_size()
    return {"us": us, "gbps": [nbytes / (t * 1e-6) / 1e9 for t in us], "exact": exact, "ok": exact}


def kernels_cases(o):
    dev = o.device
    contexts, batches, budgets = ([100, 300], [2], [4, 8]) if o.smoke else \
        ([4096, 32768, 131072], [1, 4], [64, 256, 1024])
    contexts = [int(c) for c in o.contexts.split(",")] if o.contexts else contexts
    batches = [int(b) for b in o.batches.split(",")] if o.batches else batches
    gen = torch.Generator(device=dev).manual_seed(0)
    reduce = o.gqa_reduce.split(",")[0]
    yield {"part": "bounds"}, partial(bounds_row, dev, gen)
    for batch in batches:
        for ctx in contexts:
            case = make_case(batch, ctx, dev, gen, reduce)
            for budget in budgets:
                yield ({"part": "decode", "batch": batch, "ctx": ctx, "budget": budget},
                       partial(decode_row, case, budget, o.reps))
            del case
    yield {"part": "all_pages"}, partial(all_pages_row, make_case(2, contexts[-1] // 2, dev, gen, reduce))
    if dev.startswith("cuda"):
        yield ({"part": "graph_replay"},
               partial(graph_row, make_case(4, contexts[min(1, len(contexts) - 1)], dev, gen, reduce),
                       budgets[-1]))
    yield from gather_cases(batches[-1], budgets, 4 if o.smoke else 512, o.reps, dev, gen)


# ---------------------------------------------------------------- kernel launch sweeps

def sweep_inputs(context: int, batch: int, seed: int, device: str = "cuda") -> tuple:
    """q, bounds, block tables and lengths of `batch` rows of `context` tokens (KV block 256)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks = -(-context // SWEEP_BLOCK) + 1
    pages = batch * blocks * (SWEEP_BLOCK // PAGE)
    center = torch.randn(pages, KV_HEADS, DIM, generator=gen, device=device)
    spread = torch.rand(pages, KV_HEADS, DIM, generator=gen, device=device)
    kmin, kmax = (center - spread).bfloat16(), (center + spread).bfloat16()
    tables = torch.randperm(batch * blocks, generator=gen, device=device).view(batch, blocks).int()
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, KV_HEADS * GROUP, DIM, generator=gen, device=device).bfloat16()
    return q, kmin, kmax, tables, lens


def sweep_shapes(o) -> Iterator[tuple[int, int, tuple, int]]:
    """(context, batch, inputs, max pages of a row) for each case of --contexts x --batches."""
    for context in map(int, o.contexts.split(",")):
        for batch in map(int, o.batches.split(",")):
            max_pages = -(-context // SWEEP_BLOCK) * (SWEEP_BLOCK // PAGE) + SWEEP_BLOCK // PAGE
            yield context, batch, sweep_inputs(context, batch, context + batch, o.device), max_pages


def call(data, budget_pages: int, max_pages: int, warps: int | None, head_limit: int | None = None):
    """The engine's selection (Triton) at `warps` and register head `head_limit`."""
    from astream.ops import triton_quest_select as tqs
    return tqs.select_decode_pages_triton(
        *data, max_pages=max_pages, block_size=SWEEP_BLOCK, page_size=PAGE,
        budget_pages=budget_pages, sink_pages=1, recent_pages=2, gqa_reduce="max",
        append_newest=True, physical=True, counters=None, select_warps=warps,
        max_row_in_registers=head_limit or tqs.MAX_ROW_IN_REGISTERS)


def call_ref(data, budget_pages: int, max_pages: int):
    from astream.ops.quest_select import select_decode_pages_ref
    return select_decode_pages_ref(
        *data, max_pages=max_pages, block_size=SWEEP_BLOCK, page_size=PAGE,
        budget_pages=budget_pages, sink_pages=1, recent_pages=2, gqa_reduce="max",
        append_newest=True, physical=True)


def graph_us(fn, reps: int, calls: int = 20) -> list[float]:
    """Microseconds a call: `reps` replays of a CUDA graph of `calls` calls, each divided by
    `calls`."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return [round(t * 1e3 / calls, 2) for t in cuda_times_ms(graph.replay, reps)]


def wall_us(fn, reps: int) -> list[float]:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(round((time.perf_counter() - start) * 1e6, 1))
    return times


def triton_here(device: str) -> bool:
    return device.startswith("cuda") and torch.cuda.is_available()


def reference_row(fn, reps: int) -> dict:
    return {"us": wall_us(fn, reps), "info": {"note": "torch reference, wall time: no CUDA"}}


def scores(q, kmin, kmax, tables, lens, max_pages: int, block_p: int, warps: int) -> torch.Tensor:
    import triton

    from astream.ops import triton_quest_select as tqs
    from astream.ops.triton_pages import group_tile
    out = torch.empty(q.shape[0], KV_HEADS, max_pages, dtype=torch.float32, device=q.device)
    use_dot, group_pad = group_tile(GROUP, DIM, None)
    tqs._table_scores_kernel[(q.shape[0], KV_HEADS, triton.cdiv(max_pages, block_p))](
        q, kmin, kmax, tables, lens, out, max_pages, q.stride(0), q.stride(1), kmin.stride(0),
        kmin.stride(1), kmax.stride(0), kmax.stride(1), tables.stride(0), out.stride(0),
        out.stride(1), GROUP=GROUP, GROUP_PAD=group_pad, HEAD_DIM=DIM, D_PAD=DIM, BLOCK_P=block_p,
        PAGE=PAGE, PPB=SWEEP_BLOCK // PAGE, USE_DOT=use_dot, PRECISION="tf32",
        REDUCE=tqs.REDUCE_MAX.value, num_warps=warps)
    return out


def scores_ref(data, max_pages: int):
    from astream.ops.quest_select import page_scores_ref, physical_page_ids
    q, kmin, kmax, tables, lens = data
    ids, num = physical_page_ids(tables, lens, max_pages=max_pages, block_size=SWEEP_BLOCK)
    return page_scores_ref(q, kmin, kmax, ids, num, gqa_reduce="max")


def selected_inputs(data, budget: int, max_pages: int, triton: bool = True) -> tuple:
    q, kmin, kmax, tables, lens = data
    pages, counts, _ = (call(data, budget, max_pages, None) if triton
                        else call_ref(data, budget, max_pages))
    k = torch.randn(q.shape[0] * tables.shape[1], SWEEP_BLOCK, KV_HEADS, DIM, device=q.device).bfloat16()
    v = torch.randn_like(k)
    full_lens = lens + PAGE * (SWEEP_BLOCK // PAGE)             # the newest block read whole
    return q, k, v, tables, pages, counts, full_lens


def attend(args, splits):
    from astream.ops.triton_pages import paged_decode_selected_triton
    return paged_decode_selected_triton(*args, page_size=PAGE, scale=DIM ** -0.5,
                                        num_splits=splits)[0]


def scores_row(data, max_pages: int, block_p: int, warps: int, reps: int) -> dict:
    from astream.ops import triton_quest_select as tqs
    base = scores(*data, max_pages, tqs.SCORE_BLOCK_P, 4)
    same = torch.equal(scores(*data, max_pages, block_p, warps), base)
    return {"us": graph_us(lambda: scores(*data, max_pages, block_p, warps), reps), "same": same}


def selected_row(args, splits, reps: int) -> dict:
    err = (attend(args, splits).float() - attend(args, None).float()).abs().max().item()
    return {"us": graph_us(lambda: attend(args, splits), reps), "err": err}


def kernel_sweep_cases(o):
    for context, batch, data, max_pages in sweep_shapes(o):
        case = {"context": context, "batch": batch}
        if not triton_here(o.device):
            from astream.ops.pages import paged_decode_selected_ref
            args = selected_inputs(data, o.budget // PAGE, max_pages, triton=False)
            yield ({**case, "kernel": "scores", "variant": "reference"},
                   partial(reference_row, lambda: scores_ref(data, max_pages), o.reps))
            yield ({**case, "kernel": "selected", "variant": "reference"},
                   partial(reference_row, lambda: paged_decode_selected_ref(
                       *args, page_size=PAGE, scale=DIM ** -0.5), o.reps))
            continue
        for block_p in (32, 64, 128, 256):
            for warps in (2, 4, 8):
                yield ({**case, "kernel": "scores", "block_p": block_p, "warps": warps},
                       partial(scores_row, data, max_pages, block_p, warps, o.reps))
        args = selected_inputs(data, o.budget // PAGE, max_pages)
        for splits in ("auto", 4, 8, 16, 32, 64):
            yield ({**case, "kernel": "selected", "splits": splits},
                   partial(selected_row, args, None if splits == "auto" else splits, o.reps))


def bounds_layouts(kmin: torch.Tensor, kmax: torch.Tensor) -> dict:
    """The same bounds [pages, KVH, D] stored three ways (kernels take any strides)."""
    by_head = torch.stack((kmin, kmax)).permute(0, 2, 1, 3).contiguous()      # [2, KVH, P, D]
    both = torch.stack((kmin, kmax), dim=2).permute(1, 0, 2, 3).contiguous()  # [KVH, P, 2, D]
    return {"page_major": (kmin, kmax),
            "head_major": (by_head[0].transpose(0, 1), by_head[1].transpose(0, 1)),
            "head_major_lo_hi_adjacent": (both[:, :, 0].transpose(0, 1),
                                          both[:, :, 1].transpose(0, 1))}


def layout_row(data, max_pages: int, name: str, reps: int, copies: int = 4) -> dict:
    from astream.ops import triton_quest_select as tqs
    q, kmin, kmax, tables, lens = data
    base = scores(*data, max_pages, tqs.SCORE_BLOCK_P, 4)
    n = int(lens.max()) // PAGE
    sets = [bounds_layouts(*pair)[name] for pair in
            [(kmin.clone(), kmax.clone()) for _ in range(copies)]]
    same = torch.equal(scores(q, *sets[0], tables, lens, max_pages, tqs.SCORE_BLOCK_P, 4)[..., :n],
                       base[..., :n])
    calls = iter(range(1 << 30))

    def next_copy():
        i = next(calls) % copies
        return scores(q, *sets[i], tables, lens, max_pages, tqs.SCORE_BLOCK_P, 4)
    return {"us": graph_us(next_copy, reps), "same": same}


def layouts_cases(o):
    for context, batch, data, max_pages in sweep_shapes(o):
        for name in ("page_major", "head_major", "head_major_lo_hi_adjacent"):
            case = {"context": context, "batch": batch, "layout": name}
            if not triton_here(o.device):
                q, kmin, kmax, tables, lens = data
                lo, hi = (t.contiguous() for t in bounds_layouts(kmin, kmax)[name])
                yield ({**case, "variant": "reference"},
                       partial(reference_row,
                               lambda lo=lo, hi=hi: scores_ref((q, lo, hi, tables, lens), max_pages),
                               o.reps))
            else:
                yield case, partial(layout_row, data, max_pages, name, o.reps)


def select_row(data, budget: int, max_pages: int, warps, limit, reps: int, picked: dict) -> dict:
    pages = call(data, budget, max_pages, warps, limit)[0].clone()
    first = picked.setdefault("first", pages)
    return {"us": graph_us(lambda: call(data, budget, max_pages, warps, limit), reps),
            "same_pages": bool(torch.equal(first, pages))}


def select_sweep_cases(o):
    budget = o.budget // PAGE
    for context, batch, data, max_pages in sweep_shapes(o):
        case = {"context": context, "batch": batch, "budget_pages": budget}
        if not triton_here(o.device):
            yield ({**case, "variant": "reference"},
                   partial(reference_row, lambda: call_ref(data, budget, max_pages), o.reps))
            continue
        from astream.ops import triton_quest_select as tqs
        head = tqs.register_head(max_pages - SWEEP_BLOCK // PAGE)
        variants = {f"warps{w}": (w, head) for w in (4, 8, 16)}
        variants["half_head"] = (None, head // 2)
        picked: dict = {}
        for name, (warps, limit) in variants.items():
            yield ({**case, "head": head, "variant": name},
                   partial(select_row, data, budget, max_pages, warps, limit, o.reps, picked))


# ---------------------------------------------------------------- page locality, real models

def natural_prompt(core: EngineCore, tokens: int, seed: int) -> list[int]:
    """Filler sentences up to about `tokens` tokens, then a question, as a chat turn."""
    from astream.eval.filler import filler_sentences
    rng = random.Random(seed)
    encode = core.tokenizer.encode
    ids: list[int] = []
    while len(ids) < tokens - 64:
        ids += encode(" ".join(filler_sentences(rng, 200)) + " ", add_special_tokens=False)
    question = encode(" Which of the sentences above is the most surprising, and why?",
                      add_special_tokens=False)
    return ids[: tokens - 64] + question


@contextmanager
def recording_selections(log: list):
    """QuestRuntime.select_decode wrapped so each call's (layer, page sets) lands in `log`."""
    from astream.policies.quest import QuestRuntime
    original = QuestRuntime.select_decode

    def recorded(self, layer, query):
        chosen = original(self, layer, query)
        indices, counts = chosen.indices.cpu(), chosen.counts.cpu()
        heads = [set(indices[0, h, : int(counts[0, h])].tolist()) for h in range(indices.shape[1])]
        log.append((layer, heads))
        return chosen

    QuestRuntime.select_decode = recorded
    try:
        yield
    finally:
        QuestRuntime.select_decode = original


def carried_over(steps: list[dict]) -> list[float]:
    """Per step after the first: the share of its picks also picked the step before."""
    shares = []
    for before, now in zip(steps, steps[1:]):
        kept = picked = 0
        for layer, heads in now.items():
            for head, pages in enumerate(heads):
                kept += len(pages & before[layer][head]) if layer in before else 0
                picked += len(pages)
        shares.append(kept / max(picked, 1))
    return shares


def locality_row(core: EngineCore, log: list, prompt: list[int], steps: int, natural: bool,
                 counter: list) -> dict:
    counter[0] += 1
    sink = core.add_request(f"r{len(prompt)}-{counter[0]}", prompt,
                            SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True))
    while not sink.tokens:
        core.step()
    log.clear()
    per_step = []
    while not sink.tokens[-1].finish_reason:
        core.step()
        if log:
            per_step.append(dict(log))
            log.clear()
    shares = carried_over(per_step)
    return {"carried_over": [round(s, 4) for s in shares],
            "carried_over_mean": round(statistics.mean(shares), 3) if shares else None,
            "info": {"selecting_steps": len(per_step)},
            "text": "".join(tok.text for tok in sink.tokens)[:200] if natural else None}


def locality_cases(o):
    contexts = [int(c) for c in o.ctx.split(",")]
    name = o.model or ("tiny" if o.smoke else None)
    if name is None:
        raise SystemExit("--section locality needs --model (a GGUF file, a folder or a shape)")
    shape = name if not name.endswith(".gguf") and "/" not in name else None
    natural = shape is None
    model = str(shaped_model(shape, max_positions=max(contexts) + o.steps + 8)) if shape else name
    budgets = [int(b) for b in o.budgets.split(",")]
    log: list = []
    with recording_selections(log):
        for budget in budgets:
            config = EngineConfig(
                model=model, tokenizer=o.tokenizer or (None if natural else smollm2()),
                load_format="dummy" if shape else "auto", device=o.device,
                dtype=model_dtype(o),
                max_model_len=max(contexts) + o.steps + 8, enforce_eager=True, max_num_seqs=4,
                max_num_batched_tokens=8192,
                sparse_policy=QuestPolicy(budget_tokens=budget, dense_layers=0 if o.smoke else 2))
            with engine_core(config) as core:
                for ctx in contexts:
                    gen = torch.Generator().manual_seed(ctx)
                    prompt = (natural_prompt(core, ctx, ctx) if natural
                              else torch.randint(100, 49152, (ctx,), generator=gen).tolist())
                    yield ({"model": name, "budget": budget, "context": len(prompt)},
                           partial(locality_row, core, log, prompt, o.steps, natural, [0]))
            del core                # so the next engine_core() can hand its memory back


# ---------------------------------------------------------------- profile

def profile_row(core: EngineCore) -> dict:
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    times = []
    with profile(activities=activities) as prof:
        for _ in range(4):
            start = time.perf_counter()
            core.step()
            core.runtime.synchronize()
            times.append(round((time.perf_counter() - start) * 1e3, 3))
    averages = prof.key_averages()
    print(averages.table(sort_by="cpu_time_total", row_limit=22, max_name_column_width=60))
    if torch.cuda.is_available():
        print(averages.table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    return {"step_ms": times}


def profile_cases(o):
    ctx = int(o.ctx)
    shape = "tiny" if o.smoke else "qwen3-4b"
    config = EngineConfig(model=str(shaped_model(shape, max_positions=ctx + 1024)),
                          load_format="dummy", tokenizer=o.tokenizer or synthetic_tokenizer(), device=o.device,
                          dtype=model_dtype(o), max_num_seqs=1,
                          max_model_len=ctx + 1024, offload=o.offload, enforce_eager=o.eager,
                          sparse_policy=QuestPolicy(budget_tokens=o.budget,
                                                    dense_layers=0 if o.smoke else 2),
                          max_num_batched_tokens=16384,
                          **({"kv_block_size": 16, "offload_slot_tokens": 64}
                             if o.smoke and o.offload else {}))
    with engine_core(config) as core:
        prompt = torch.randint(100, 49152, (ctx,), generator=torch.Generator().manual_seed(0)).tolist()
        sink = core.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=100_000,
                                                            ignore_eos=True))
        while not sink.tokens:
            core.step()
        for _ in range(3):
            core.step()
        core.runtime.synchronize()
        yield ({"shape": shape, "context": ctx, "budget": o.budget, "offload": o.offload,
                "eager": o.eager}, partial(profile_row, core))


# ---------------------------------------------------------------- page reuse, real models

def reuse_run(config: EngineConfig, ctx: int, steps: int) -> dict:
    with engine_core(config) as core:
        prompt = natural_prompt(core, ctx, seed=ctx)
        params = SamplingParams(temperature=0.0, max_tokens=4 * steps + 8, ignore_eos=True)
        sink = core.add_request("r", prompt, params)
        while not sink.tokens:
            core.step()
        decode_steps(core, 2)                                    # warm-up
        before = core.stats()
        times = decode_steps(core, steps)
        after = core.stats()
        pipelined = pipelined_steps(core, steps)
        per_step = {key: (sum(after[key]) - sum(before[key])) / steps
                    for key in ("quest_pages_read", "quest_pages_loaded")}
        return {"step_ms": ms(times), "pipelined_step_ms": ms(pipelined),
                "pages_read_per_step": round(per_step["quest_pages_read"], 1),
                "pages_loaded_per_step": round(per_step["quest_pages_loaded"], 1),
                "context": len(prompt), "text": "".join(tok.text for tok in sink.tokens)[:120]}


def reuse_row(o, model: str, ctx: int, **engine) -> dict:
    row: dict = {"info": {}}
    for reuse in (False, True):
        config = EngineConfig(
            model=model, **engine, device=o.device, dtype=model_dtype(o),
            offload=True, max_num_seqs=1, max_model_len=ctx + 4 * o.steps + 64,
            max_num_batched_tokens=8192,
            sparse_policy=QuestPolicy(budget_tokens=o.budget, dense_layers=0 if o.smoke else 2,
                                      reuse_pages=reuse))
        one = reuse_run(config, ctx, o.steps)
        suffix = "_on" if reuse else "_off"
        row["info"]["context"] = one.pop("context")
        row["info"]["text" + suffix] = one.pop("text")
        row.update({key + suffix: value for key, value in one.items()})
    return row


def reuse_cases(o):
    ctx = int(o.ctx)
    engine = {}
    model = o.model
    if o.smoke and not model:     # random weights in a tiny shape, SmolLM2's tokenizer
        model = str(shaped_model("tiny", max_positions=ctx + 4 * o.steps + 64))
        engine = {"load_format": "dummy", "tokenizer": smollm2()}
    if not model:
        raise SystemExit("--section reuse needs --model (a GGUF file or model folder)")
    yield ({"model": model, "context": ctx, "budget": o.budget},
           partial(reuse_row, o, model, ctx, **engine))


# ---------------------------------------------------------------- decode over a filled cache

GROUPS = {"auto": {}, "on": {"group_above_pages": 0}, "off": {"group_above_pages": 1 << 62}}
GiB = 2**30


def parse_cases(text: str) -> list[tuple[int, int]]:
    return [tuple(map(int, c.split("x"))) for c in text.split(",")]


def pool_figures(core: EngineCore, engine_s: float) -> dict:
    """The memory plan, and what was measured: host memory pinned, device memory in use."""
    pool = core.runner.offload.host_pool
    memory = core.plan.memory
    info = {"plan": memory.describe(), "plan_host_gib": round(memory.host_pool / GiB, 2),
            "plan_device_gib": round(memory.device_total / GiB, 2),
            "host_pinned_gib": round(pool.nbytes / GiB, 2) if pool.pieces else 0.0,
            "pool_pieces": pool.pieces, "pool_alloc_s": round(pool.seconds, 2),
            "engine_s": round(engine_s, 2)}
    if torch.cuda.is_available() and core.runtime.is_cuda:
        free, total = torch.cuda.mem_get_info(core.runtime.device)
        info.update(device_used_gib=round((total - free) / GiB, 2),
                    device_allocated_gib=round(torch.cuda.max_memory_allocated() / GiB, 2))
    return info


def filled_row(core: EngineCore, steps: int, prefill_s: float, info: dict) -> dict:
    before = core.stats()
    row = measure_steps(core, steps, prefill_s)
    after = core.stats()
    layer = -1                                     # a sparse layer: pages per selection there
    picks = after["quest_pages_read"][layer] - before["quest_pages_read"][layer]
    rows = after["quest_selections"][layer] - before["quest_selections"][layer]
    # Every selection reads exactly the budget's pages (the contexts pass it).
    budget_pages = core.runner.policy.policy.budget_pages
    row["info"].update(info, pages_per_selection=round(picks / max(rows, 1), 2),
                       ok=rows > 0 and picks == rows * budget_pages)
    return row


def filled_config(o, kv: str, ctx: int, batch: int, budget: int, tokenizer: str) -> EngineConfig:
    """An offloaded engine with Quest at `budget` for `batch` sequences of `ctx` tokens, whose
    cache kv_fill can write (`fill_contexts`)."""
    # The tiny shape's 64-token blocks hold one group of 4 pages: every path is on.
    return EngineConfig(
        model=str(shaped_model(o.shape, max_positions=ctx)), load_format="dummy",
        tokenizer=tokenizer, device=o.device, dtype=model_dtype(o),
        offload=True, kv_cache_dtype=kv, max_num_seqs=batch, max_model_len=ctx,
        max_num_batched_tokens=16384, enforce_eager=o.eager,
        sparse_policy=QuestPolicy(budget_tokens=budget, dense_layers=1 if o.smoke else 2,
                                  keys_on_device=o.keys_on_device,
                                  gqa_reduce=o.gqa_reduce.split(",")[0],
                                  **({"group_pages": 4} if o.shape == "tiny" else {})),
        **({"kv_block_size": 64} if o.shape == "tiny" else {}))


def fill_contexts(core: EngineCore, ctx: int, batch: int, info: dict) -> list[list[int]]:
    """`batch` random prompts of `ctx` tokens less one block, their KV but the last block's
    written into the host pool (kv_fill); `fill_s` and `filled_tokens` go to `info`."""
    from kv_fill import fill_prefix
    block = core.plan.block_size
    gen = torch.Generator().manual_seed(ctx)
    prompts = [torch.randint(100, 49152, (ctx - block,), generator=gen).tolist() for _ in range(batch)]
    start = time.perf_counter()
    filled = [fill_prefix(core, prompt, seed=i) for i, prompt in enumerate(prompts)]
    info.update(fill_s=round(time.perf_counter() - start, 2), filled_tokens=filled[0])
    return prompts


def filled_cases(o):
    """`filled`: decode steps over contexts written straight into the host pool (kv_fill),
    one engine per (kv dtype, case), sized by the engine itself from max_model_len = the
    case's context; the prompt is that context less one block, whose prefill is the first
    step (it attends to the whole context)."""
    groups = o.groups.split(",")
    budgets = [int(b) for b in o.budgets.split(",")]
    for kv in o.kv_dtypes.split(","):
        for ctx, batch in parse_cases(o.cases):
            config = filled_config(o, kv, ctx, batch, max(budgets), o.tokenizer or synthetic_tokenizer())
            start = time.perf_counter()
            with engine_core(config) as core:
                info = pool_figures(core, time.perf_counter() - start)
                params = SamplingParams(temperature=0.0, max_tokens=core.plan.block_size - 1,
                                        ignore_eos=True)
                prompts = fill_contexts(core, ctx, batch, info)
                sinks = [core.add_request(f"f{i}", prompt, params) for i, prompt in enumerate(prompts)]
                start = time.perf_counter()
                while not all(sink.tokens for sink in sinks):
                    core.step()
                core.runtime.synchronize()
                first_s = time.perf_counter() - start
                info["prefix_hits"] = core.stats()["prefix_cache_hits"]
                for budget in budgets:
                    for group in groups:
                        set_budget(core, budget, core.runner.decoder.kernels.name, **GROUPS[group])
                        decode_steps(core, 2)                    # warm-up (and Triton compiles)
                        yield ({"mode": "offload", "kv": kv, "context": ctx, "batch": batch,
                                "budget": budget, "groups": group},
                               partial(filled_row, core, o.steps, first_s, dict(info)))
                for i in range(batch):
                    core.abort(f"f{i}")


# ---------------------------------------------------------------- prefetch keeps the tokens

def prefetch_tokens(config: EngineConfig, prompts: list[list[int]], steps: int) -> tuple[list, dict]:
    with engine_core(config) as core:
        params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
        sinks = [core.add_request(f"p{i}", prompt, params) for i, prompt in enumerate(prompts)]
        while core.scheduler.has_work():
            core.step()
        stats = core.stats()
        tokens = [[t.token_id for t in sink.tokens] for sink in sinks]
    pages = {key: sum(stats.get(key, [])) for key in
             ("quest_pages_read", "quest_pages_loaded", "quest_pages_loaded_late")}
    decode_steps_run = max(steps - 1, 1)
    info = {"graph_steps": stats["graph_steps"],
            "pages_read_per_step": round(pages["quest_pages_read"] / decode_steps_run, 1),
            "pages_early_per_step": round((pages["quest_pages_loaded"]
                                           - pages["quest_pages_loaded_late"]) / decode_steps_run, 1),
            "pages_late_per_step": round(pages["quest_pages_loaded_late"] / decode_steps_run, 1)}
    return tokens, info


def prefetch_row(info: dict, same: int, batch: int, exact: bool) -> dict:
    """`exact`: float32, where reading pages in another order cannot flip a greedy token, so
    a different token is a defect; in bf16 (the GPU run) random weights' logits nearly tie
    and the count is reported only (gpu_correctness.py checks the tokens on real weights)."""
    late = info.pop("pages_late_per_step")
    return {"pages_late_per_step": [late],
            "info": {**info, "same_tokens": f"{same}/{batch}",
                     "ok": same == batch or not exact}}


def prefetch_cases(o):
    shape = "tiny" if o.smoke else "qwen3-4b"
    values = [float(p) for p in o.prefetch.split(",")]
    values = [0.0] + [p for p in values if p]
    for kv in o.kv_dtypes.split(","):
        for ctx, batch in parse_cases(o.cases):
            gen = torch.Generator().manual_seed(ctx + batch)
            prompts = [torch.randint(100, 49152, (ctx,), generator=gen).tolist() for _ in range(batch)]
            want = None
            for prefetch in values:
                config = EngineConfig(
                    model=str(shaped_model(shape, max_positions=ctx + o.steps + 64)),
                    load_format="dummy", tokenizer=o.tokenizer or synthetic_tokenizer(), device=o.device,
                    dtype=model_dtype(o), offload=True,
                    kv_cache_dtype=kv, max_num_seqs=batch, max_model_len=ctx + o.steps + 64,
                    max_num_batched_tokens=16384, enforce_eager=o.eager,
                    sparse_policy=QuestPolicy(budget_tokens=o.budget, dense_layers=0 if o.smoke else 2,
                                              prefetch=prefetch),
                    **({"kv_block_size": 16, "offload_slot_tokens": 64} if o.smoke else {}))
                tokens, info = prefetch_tokens(config, prompts, o.steps)
                if want is None:
                    want = tokens
                same = sum(a == b for a, b in zip(tokens, want))
                yield ({"kv": kv, "context": ctx, "batch": batch, "budget": o.budget,
                        "prefetch": prefetch},
                       partial(prefetch_row, info, same, batch, o.device == "cpu"))


# ---------------------------------------------------------------- the same tokens at long contexts

# Per check, where --ctx and --kv-dtypes name none: its context (with --smoke) and KV dtype.
AGREEMENT_CONTEXTS = {"covering": 1048576, "offload": 65536}
AGREEMENT_SMOKE_CONTEXTS = {"covering": 2048, "offload": 1024}
AGREEMENT_KV = {"covering": "fp8_e4m3", "offload": "auto"}


def parting(reference: list[StreamToken], got: list[StreamToken],
            limits: tuple[float, float]) -> dict:
    """Two greedy runs of one prompt (tokens with their top-2 logprobs) against each other:
    `identical_tokens` before they part; where they part, the step and both runs' top-2
    margins there (in nats, the logits' difference); `logprob_drift`, the largest difference
    of a token's logprob before that, which is how far rounding moved the two runs apart.
    `limits` (tie, drift): a parting beyond `tie` of the reference's top two, or a drift
    beyond `drift`, fails the row."""
    tie, drift_limit = limits
    ids = [[t.token_id for t in run] for run in (reference, got)]
    found = agreement(ids[:1], [top2_margins(reference)], ids[1:], tie)
    part = found["parts"][0] if found["parts"] else None
    same = part["step"] if part else len(reference)
    if part is not None:
        del part["row"]
        part["compared_margin"] = round(top2_margins(got)[same], 4) if same < len(got) else None
    drift = max((abs(a.logprob - b.logprob) for a, b in zip(reference[:same], got[:same])),
                default=0.0)
    return {"identical_tokens": same, "logprob_drift": round(drift, 6),
            "info": {"tokens": len(reference), "parting": part, "reference": ids[0],
                     "compared": ids[1], "ok": found["ok"] and drift <= drift_limit}}


def timed_run(core: EngineCore, tag: str, prompt: list[int],
              steps: int) -> tuple[list[StreamToken], float]:
    """`steps` greedy tokens of `prompt` with their top-2 logprobs, and the seconds they took."""
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=2)
    start = time.perf_counter()
    tokens = run_requests(core, tag, [prompt], [params])[0]
    core.runtime.synchronize()
    return tokens, round(time.perf_counter() - start, 2)


def covering_row(o, kv: str, ctx: int, group: str, limits: tuple[float, float]) -> dict:
    """`covering`: one offloaded engine over one filled context: Full (a budget no context reaches,
    which reads every offloaded layer through the ring), then Quest at a budget of the whole context,
    selecting from the first decode step, so every page of the context is picked and
    gathered. Both prefill the prompt's last block the same way (the prefix cache never
    hands out a prompt's last block), so the runs part only where decode differs."""
    start = time.perf_counter()
    with engine_core(filled_config(o, kv, ctx, 1, ctx, o.tokenizer or synthetic_tokenizer())) as core:
        info = pool_figures(core, time.perf_counter() - start)
        block, page = core.plan.block_size, core.runner.policy.policy.page_size
        if o.steps >= block:
            raise SystemExit(f"--steps must be below the KV block ({block} tokens): the prompt "
                             f"leaves one block of the context for them")
        prompt = fill_contexts(core, ctx, 1, info)[0]
        kernels = core.runner.decoder.kernels.name
        set_budget(core, FULL, kernels, **GROUPS[group])
        start_stats = core.stats()
        full, full_s = timed_run(core, "full", prompt, o.steps)
        # Before the Quest graphs are captured: their warm-up steps select too.
        full_dense = sum(core.stats()["quest_selections"]) == sum(start_stats["quest_selections"])
        set_budget(core, ctx, kernels, select_above=0, **GROUPS[group])
        before = core.stats()
        quest, quest_s = timed_run(core, "quest", prompt, o.steps)
        after = core.stats()
        heads = core.runner.decoder.config.num_kv_heads
        sparse = [layer for layer, b in enumerate(core.runner.policy.bounds) if b is not None]
    read, rows = ([a - b for a, b in zip(after[key], before[key])]
                  for key in ("quest_pages_read", "quest_selections"))
    # A decode step selects among the host blocks before its newest token's: every page of them.
    steps = o.steps - 1
    pages = sum((len(prompt) + t) // block * block // page for t in range(steps))
    every_page = all(read[layer] == heads * pages and rows[layer] == heads * steps for layer in sparse)
    row = parting(full, quest, limits)
    row["info"].update(info, every_page=every_page, full_dense=full_dense,
                       pages_per_selection=round(read[-1] / max(rows[-1], 1), 2),
                       context_pages=round(pages / max(steps, 1), 2),
                       ok=row["info"]["ok"] and every_page and full_dense)
    return {**row, "seconds_full": full_s, "seconds_quest": quest_s}


def weights_fingerprint(core: EngineCore) -> list[float]:
    """Sums of the first and last weights drawn and one between: equal in two engines only
    where their random weights are."""
    weights = core.runner.decoder.weights
    return [t.float().sum().item() for t in (weights.embed[:4096], weights.layers[0].qkv,
                                            weights.layers[-1].down)]


def offload_row(o, kv: str, ctx: int, limits: tuple[float, float]) -> dict:
    """`offload`: Full attention, resident (the reference) and offloaded, one engine each over the
    same random weights (load_format="dummy" draws them from a generator seeded alike):
    each prefills the prompt and decodes greedily."""
    tiny = o.shape == "tiny"
    base = dict(model=str(shaped_model(o.shape, max_positions=ctx + o.steps)), load_format="dummy",
                tokenizer=o.tokenizer or synthetic_tokenizer(), device=o.device,
                dtype=agreement_dtype(o), kv_cache_dtype=kv,
                max_num_seqs=1, max_model_len=ctx + o.steps, max_num_batched_tokens=16384,
                enforce_eager=o.eager, **({"kv_block_size": 16} if tiny else {}))
    prompt = torch.randint(100, 49152, (ctx,), generator=torch.Generator().manual_seed(ctx)).tolist()
    runs, seconds, weights = {}, {}, {}
    # Small ring slots, so the tiny shape's context crosses several of them.
    modes = {"resident": {},
             "offload": dict(offload=True, **({"offload_slot_tokens": 64} if tiny else {}))}
    for mode, offload in modes.items():
        with engine_core(EngineConfig(**base, **offload)) as core:
            weights[mode] = weights_fingerprint(core)
            runs[mode], seconds[mode] = timed_run(core, mode, prompt, o.steps)
        del core                    # so the next engine_core() can hand its memory back
    row = parting(runs["resident"], runs["offload"], limits)
    same_weights = weights["resident"] == weights["offload"]
    row["info"].update(same_weights=same_weights, ok=row["info"]["ok"] and same_weights)
    return {**row, "seconds_resident": seconds["resident"], "seconds_offload": seconds["offload"]}


def agreement_dtype(o) -> str:
    """The model's dtype of an `agreement` offload run: --dtype, or `model_dtype`."""
    return model_dtype(o) if o.dtype == "auto" else o.dtype


def agreement_cases(o):
    """`agreement`: per check, context and KV dtype, one row comparing greedy tokens."""
    for check in o.checks.split(","):
        if check not in AGREEMENT_CONTEXTS:
            raise SystemExit(f"--checks: {check!r} is not one of {', '.join(AGREEMENT_CONTEXTS)}")
        # float32 (the CPU's; `offload` takes --dtype, `covering` the filled engine's): no
        # parting is a near tie there, and logprobs agree to rounding.
        dtype = agreement_dtype(o) if check == "offload" else model_dtype(o)
        limits = (-math.inf, EXACT_DRIFT) if dtype == "float32" else (o.tie, math.inf)
        contexts = ([int(c) for c in o.ctx.split(",")] if o.ctx
                    else [(AGREEMENT_SMOKE_CONTEXTS if o.smoke else AGREEMENT_CONTEXTS)[check]])
        for kv in (o.kv_dtypes or AGREEMENT_KV[check]).split(","):
            for ctx in contexts:
                params = {"check": check, "kv": kv, "context": ctx, "steps": o.steps}
                if check == "offload":
                    yield params, partial(offload_row, o, kv, ctx, limits)
                    continue
                for group in o.groups.split(","):
                    yield ({**params, "budget": ctx, "groups": group},
                           partial(covering_row, o, kv, ctx, group, limits))


SECTION_CASES = {"speed": speed_cases, "kernels": kernels_cases,
                 "kernel_sweep": kernel_sweep_cases, "layouts": layouts_cases,
                 "select_sweep": select_sweep_cases, "locality": locality_cases,
                 "profile": profile_cases, "reuse": reuse_cases, "filled": filled_cases,
                 "prefetch": prefetch_cases, "agreement": agreement_cases}
