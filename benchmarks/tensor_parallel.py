"""Tensor parallelism: decode, throughput and offloaded decode at TP=1 against TP=2, and a
check that decode steps from CUDA graphs give every rank's tokens.

    python benchmarks/run.py tensor_parallel [--sections decode,throughput,offload,quest] [--tp 1,2]
    python benchmarks/run.py tensor_parallel --sections check    # two GPUs: graphs' tokens
    python benchmarks/run.py tensor_parallel --sections faults   # two GPUs: a rank's death,
                                                                 # a failed capture, a clean close
    python benchmarks/run.py tensor_parallel --smoke        # CPU over gloo, tiny shape and contexts

The Qwen3-8B shape (36 layers, hidden 4096, 32 query and 8 KV heads of 128, MLP 12288,
vocabulary 151,936), random weights (load_format="dummy"), bf16, SmolLM2's tokenizer (the
prompts are random ids). Each section builds one engine per TP size, TP=1 first; the rows
of a section come before the next section's, so a run cut short keeps whole pairs.

- `decode`: resident KV, --decode [32768x4] (CTXxBATCH). The sequences are prefilled once;
  a run then times --steps [16] decode steps two ways: `step_ms`, synchronously (each
  EngineCore.step with the device synchronized: its whole latency, host work included), and
  `pipelined_step_ms`, as the engine's stages run them (the next step launched before the
  previous one is read back): the interval between consecutive steps' results.
- `throughput`: `LLM.generate` over the workload of benchmarks/throughput.py (--num [256]
  requests, input and output lengths uniform in 100..1024, greedy, ignore_eos),
  `output_tok_s`. Prefix caching is off, so every repeat computes the same prompts anew.
- `offload`: offload=True, Full attention, --offload [131072x4,131072x1]. Each context is
  prefilled once with its largest batch; its batches are then timed largest first, the extra
  sequences aborted in between. --offload-steps [4] synchronous steps a run (a step loads
  every sequence's whole context, seconds at 128K), and the bytes rank 0 loaded from its
  host pool in them: `bytes_loaded_per_step`, and `link_gb_s` = those bytes over the steps'
  time. Each rank loads the same block ids of its own KV heads over its own PCIe link, so
  rank 0's count is every rank's: the figure is per link.
- `quest`: the same with sparse_policy Quest (--budget [4096] tokens; its first dense_layers
  [2] layers read whole contexts; --quest-options its other fields, as in a policy spec, e.g.
  "prefetch=1,late_fetch=False,keys_on_device=True"), --quest [131072x1], --steps steps
  timed both ways. The bytes add the pages gathered from the host pool
  (`bytes_gathered_per_step`: rank 0's selections, for its own KV heads) to the dense layers'
  loads: the pages' values alone where the device keeps the keys, and only the pages that
  loaded where they go through page buffers (a prefetch's, or reuse_pages'), which
  `pages_loaded_per_step` counts.

Decode steps run from CUDA graphs where the engine captures them, at every TP size (each rank
replays the same graph, the collectives inside it), unless --eager (every engine eager: the
split's own gain, without the graphs').

- `check` (only when named in --sections): greedy tokens of decode steps from CUDA graphs at
  TP=2 against TP=2 eager and TP=1 eager, on the shapes of --check-shapes [tiny,qwen3-8b],
  resident and offloaded under Quest (a budget below the contexts, so the graphs gather
  selected pages): --check-prompts [3] random prompts of different lengths, each stopping
  after a different number of tokens, so batches pad and shrink. bf16 logits tie, and the
  split sums in another order, so two runs may part where the reference's top two logits
  are within --tie [0.25] of each other; a row fails where they part elsewhere, where no step
  ran from the graphs, or where TP=2's temperature rows (sampled inside the graphs) do not
  finish. With --smoke, on the CPU, the graphs' static programs run eagerly on every rank.

- `profile` (only when named in --sections): the throughput workload once more per repeat,
  rank 0's CUDA kernels profiled over --profile-steps [40] steps from step --profile-from
  [300] (decode steps of a full batch): `step_ms`, the steps' wall time each, and their
  kernels' time a step by kind (`attention_ms`, `gemm_ms`, `all_reduce_ms`,
  `logits_gather_ms` for the vocabulary shards' all-gather, `other_ms`; `busy_ms` their sum):
  where a TP step's time goes.

- `faults` (only when named in --sections): benchmarks/tp_faults.py's scenarios, each in a
  process of its own: a clean close without NCCL's watchdog trace, a rank killed during the
  decode graphs' capture and during decode (the engine names it within a minute, not after
  NCCL's 300 s), and a failed capture that releases the graphs it had captured. Each row's
  info holds the scenario's figures and the alarming lines of its stderr.

After the rows, a table of each figure's median per TP size and the ratio of the largest
TP to the smallest, against the goals: offloaded Full decode at <= 0.55x, Quest offload at
<= 0.6x, throughput >= 1.7x.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from functools import partial
from typing import Iterator

import torch

from common import (agreement, engine_core, random_workload, run_requests, shaped_model,  # noqa: I001
                    synthetic_tokenizer, top2_margins)
from quest import decode_steps, ms, page_bytes, pages_crossed, pipelined_steps
from throughput import astream_run
from tp_faults import fault_cases
from astream import LLM, SamplingParams
from astream.base.config import EngineConfig
from astream.core.engine_core import EngineCore
from astream.core.request import ListSink
from astream.executor.build import capture_graphs, graph_spec
from astream.policies import QuestPolicy
from astream.policies.spec import parse_policy_spec

SECTIONS = ("decode", "throughput", "offload", "quest")
MARGIN = 1024                        # tokens past the context: decode steps of every repeat
LONG = SamplingParams(temperature=0.0, max_tokens=1 << 30, ignore_eos=True)
# (section, figure) -> (comparison, ratio of the largest TP to the smallest)
GOALS = {("offload", "step_ms"): ("<=", 0.55), ("quest", "step_ms"): ("<=", 0.6),
         ("throughput", "output_tok_s"): (">=", 1.7)}
TABLE = {"decode": ("step_ms", "pipelined_step_ms"), "throughput": ("output_tok_s",),
         "profile": ("step_ms", "busy_ms", "attention_ms", "gemm_ms", "all_reduce_ms",
                     "logits_gather_ms", "other_ms"),
         "offload": ("step_ms", "link_gb_s"), "quest": ("step_ms", "pipelined_step_ms", "link_gb_s")}

DEFAULTS = dict(decode="32768x4", offload="131072x4,131072x1", quest="131072x1", steps=16,
                offload_steps=4, num=256, budget=4096, dense_layers=2, profile_from=300,
                profile_steps=40)
SMOKE = dict(decode="128x2", offload="192x2,192x1", quest="256x1", steps=3, offload_steps=2,
             num=6, budget=64, dense_layers=0, profile_from=2, profile_steps=3)


def add_arguments(parser) -> None:
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help="comma-separated, run in this order: " + ", ".join(SECTIONS))
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes, each section in turn")
    parser.add_argument("--decode", default=None, help="decode: CTXxBATCH cases [32768x4]")
    parser.add_argument("--offload", default=None, help="offload: CTXxBATCH cases [131072x4,131072x1]")
    parser.add_argument("--quest", default=None, help="quest: CTXxBATCH cases [131072x1]")
    parser.add_argument("--steps", type=int, default=None, help="decode, quest: steps timed a run [16]")
    parser.add_argument("--offload-steps", type=int, default=None, help="offload: steps timed a run [4]")
    parser.add_argument("--num", type=int, default=None, help="throughput: requests [256]")
    parser.add_argument("--budget", type=int, default=None, help="quest: tokens read per KV head [4096]")
    parser.add_argument("--dense-layers", type=int, default=None,
                        help="quest: first layers that read whole contexts [2]")
    parser.add_argument("--quest-options", default="",
                        help="quest: QuestPolicy's other fields, key=value,... (e.g. prefetch=1,"
                             "late_fetch=False,keys_on_device=True)")
    parser.add_argument("--profile-from", type=int, default=None,
                        help="profile: the first step profiled [300]")
    parser.add_argument("--profile-steps", type=int, default=None, help="profile: steps profiled [40]")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs at any TP size")
    parser.add_argument("--shape", default=None, help="a shape of common.SHAPES [qwen3-8b]")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer (default: SmolLM2's)")
    parser.add_argument("--check-shapes", default=None, help="check: shapes [tiny,qwen3-8b]")
    parser.add_argument("--check-prompts", type=int, default=3, help="check: prompts a run [3]")
    parser.add_argument("--tie", type=float, default=0.25,
                        help="check: a reference top-2 logit margin runs may part at [0.25]")


def cases(options) -> Iterator[tuple[dict, object]]:
    for key, value in (SMOKE if options.smoke else DEFAULTS).items():
        if getattr(options, key) is None:
            setattr(options, key, value)
    options.shape = options.shape or ("tiny" if options.smoke else "qwen3-8b")
    sections = [s for s in options.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS) - {"check", "faults", "profile"}
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}: choose from check, faults, profile, "
                         f"{', '.join(SECTIONS)}")
    sizes = [int(t) for t in options.tp.split(",")]
    for section in sections:
        if section == "check":
            yield from check_cases(options)
            continue
        if section == "faults":
            yield from fault_cases(options)
            continue
        for tp in sizes:
            yield from SECTION_CASES[section](options, tp)


def parse_cases(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in case.split("x")) for case in text.split(",") if case]


def engine_options(o, tp: int, shapes: list[tuple[int, int]], **extra) -> dict:
    """An engine's options for `shapes` (max_num_seqs their largest batch, which with offload
    also sizes the host pool), random weights."""
    ctx = max(c for c, _ in shapes) + MARGIN
    return dict(model=str(shaped_model(o.shape, max_positions=ctx)), load_format="dummy",
                tokenizer=o.tokenizer or synthetic_tokenizer(), device=o.device,
                dtype="float32" if o.device == "cpu" else "bfloat16",
                max_num_seqs=max(b for _, b in shapes), max_model_len=ctx,
                tensor_parallel_size=tp, enforce_eager=o.eager, **extra)


def core_config(o, tp: int, shapes: list[tuple[int, int]], **extra) -> EngineConfig:
    # Prefill chunks of 16K tokens: the long prompts take fewer steps.
    return EngineConfig(**engine_options(o, tp, shapes, max_num_batched_tokens=16384, **extra))


# ---------------------------------------------------------------- decode steps

def prefill(core: EngineCore, ctx: int, batch: int, seed: int) -> tuple[list[str], list[ListSink], float]:
    """`batch` random prompts of `ctx` tokens added and stepped until each has its first token."""
    gen = torch.Generator().manual_seed(seed)
    ids = [f"c{ctx}-{seed}-{i}" for i in range(batch)]
    sinks = [core.add_request(rid, torch.randint(100, 49152, (ctx,), generator=gen).tolist(), LONG)
             for rid in ids]
    start = time.perf_counter()
    while not all(sink.tokens for sink in sinks):
        core.step()
    core.runtime.synchronize()
    return ids, sinks, time.perf_counter() - start


def measure(core: EngineCore, sinks: list[ListSink], steps: int, pipelined: bool,
            prefill_s: float) -> dict:
    before = core.stats()
    times = decode_steps(core, steps)
    after = core.stats()
    row: dict = {"step_ms": ms(times)}
    if pipelined:
        row["pipelined_step_ms"] = ms(pipelined_steps(core, steps + 1))   # `steps` intervals
    if after["offload"]:
        loaded = after["offload_bytes_loaded"] - before["offload_bytes_loaded"]
        crossed, _, buffered = pages_crossed(before, after)
        gathered = crossed * page_bytes(core) if crossed else 0
        row["bytes_loaded_per_step"] = loaded // steps
        if "quest_pages_read" in after:
            row["bytes_gathered_per_step"] = gathered // steps
            row["pages_loaded_per_step"] = buffered // steps
        row["link_gb_s"] = (loaded + gathered) / sum(times) / 1e9
    # A sequence that reached max_model_len would leave steps that decode fewer rows.
    running = all(not sink.tokens[-1].finish_reason for sink in sinks)
    row["info"] = {"ok": running, "prefill_s": round(prefill_s, 2),
                   "graph_steps": after["graph_steps"] - before["graph_steps"]}
    return row


def step_cases(config: EngineConfig, params: dict, shapes: list[tuple[int, int]], steps: int,
               pipelined: bool, warmup: int):
    """One engine: per context, its largest batch prefilled once, then each of its batches,
    largest first (the extra sequences aborted), warmed up and yielded as a case."""
    contexts: dict[int, list[int]] = {}
    for ctx, batch in shapes:
        contexts.setdefault(ctx, []).append(batch)
    with engine_core(config) as core:
        for seed, (ctx, batches) in enumerate(contexts.items()):
            ids, sinks, prefill_s = prefill(core, ctx, max(batches), seed)
            for batch in sorted(set(batches), reverse=True):
                for rid in ids[batch:]:
                    core.abort(rid)
                ids, sinks = ids[:batch], sinks[:batch]
                decode_steps(core, warmup)               # the batch's first steps: compiles
                yield ({**params, "context": ctx, "batch": batch},
                       partial(measure, core, sinks, steps, pipelined, prefill_s))
            for rid in ids:
                core.abort(rid)
    del core                         # so the next engine_core() can hand its memory back


def decode_cases(o, tp: int):
    shapes = parse_cases(o.decode)
    yield from step_cases(core_config(o, tp, shapes), {"section": "decode", "tp": tp}, shapes,
                          o.steps, True, 2)


def offload_extra(o) -> dict:
    return {"offload": True, "kv_block_size": 16 if o.smoke else 256,
            **({"offload_slot_tokens": 64} if o.smoke else {})}


def offload_cases(o, tp: int):
    shapes = parse_cases(o.offload)
    config = core_config(o, tp, shapes, **offload_extra(o))
    yield from step_cases(config, {"section": "offload", "tp": tp}, shapes, o.offload_steps, False, 1)


def quest_cases(o, tp: int):
    shapes = parse_cases(o.quest)
    [(_, fields)] = parse_policy_spec(f"quest({o.quest_options})")
    policy = QuestPolicy(budget_tokens=o.budget, dense_layers=o.dense_layers, **fields)
    config = core_config(o, tp, shapes, sparse_policy=policy, **offload_extra(o))
    yield from step_cases(config, {"section": "quest", "tp": tp, "budget": o.budget,
                                   "dense_layers": o.dense_layers, **fields},
                          shapes, o.steps, True, 2)


# ---------------------------------------------------------------- throughput

def throughput_row(llm: LLM, work: list[tuple[list[int], int]]) -> dict:
    run = astream_run(llm, work)
    return {"output_tok_s": run["output_tok_s"], "total_tok_s": run["total_tok_s"],
            "info": {key: run[key] for key in ("seconds", "output_tokens", "steps", "preemptions")}}


@contextmanager
def throughput_engine(o, tp: int) -> Iterator[tuple[LLM, list[tuple[list[int], int]]]]:
    """throughput.py's engine (max_model_len 2112, 256 sequences, the default prefill chunks;
    prefix caching off), warmed up, and its workload."""
    work = random_workload(o.num, 10, 40, 5, 20) if o.smoke else \
        random_workload(o.num, 100, 1024, 100, 1024)
    with LLM(**engine_options(o, tp, [(2112 - MARGIN, 256)], enable_prefix_caching=False)) as llm:
        llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=8, ignore_eos=True))   # warm-up
        yield llm, work


def throughput_cases(o, tp: int):
    with throughput_engine(o, tp) as (llm, work):
        yield ({"section": "throughput", "tp": tp, "requests": len(work)},
               partial(throughput_row, llm, work))


# ---------------------------------------------------------------- profile

# A CUDA kernel's kind, by the first of these its name holds (cuBLAS's GEMMs are nvjet_* on
# Hopper). With --smoke, on the CPU, the profiler sees only the steps' own records (the model
# runs in the engine's thread), so all of a step's time counts as "other" there.
KERNEL_KINDS = (("all_reduce", ("AllReduce",)), ("logits_gather", ("AllGather",)),
                ("attention", ("_decode", "_selected_split", "_prefill", "flash", "fmha",
                               "attention")),
                ("gemm", ("nvjet", "gemm", "cutlass", "splitKreduce")))


def kernel_kind(name: str) -> str:
    return next((kind for kind, marks in KERNEL_KINDS if any(m in name for m in marks)), "other")


def profile_row(llm: LLM, work: list[tuple[list[int], int]], first: int, steps: int) -> dict:
    """The workload once, rank 0's CUDA kernels (on the CPU: its ops) profiled over `steps`
    steps from step `first`."""
    from torch.profiler import ProfilerActivity, profile, schedule
    warmup = 2
    marks: list[float] = []
    cuda = torch.cuda.is_available()
    profiler = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU],
                       schedule=schedule(wait=first, warmup=warmup, active=steps, repeat=1))
    process = EngineCore.process

    def stepped(core, output):
        delivered = process(core, output)
        marks.append(time.perf_counter())
        profiler.step()
        return delivered

    EngineCore.process = stepped
    try:
        with profiler:
            astream_run(llm, work)
    finally:
        EngineCore.process = process
    start = first + warmup - 1                  # marks[start]: the step before the first profiled
    if len(marks) <= start + steps:
        raise SystemExit(f"profile: the workload ran {len(marks)} steps, fewer than "
                         f"--profile-from + --profile-steps + {warmup}")
    kinds = dict.fromkeys([kind for kind, _ in KERNEL_KINDS] + ["other"], 0.0)
    for event in profiler.key_averages():
        self_us = event.self_device_time_total if cuda else event.self_cpu_time_total
        kinds[kernel_kind(event.key)] += self_us / 1e3 / steps
    figures = {f"{kind}_ms": [round(ms, 4)] for kind, ms in kinds.items()}
    return {"step_ms": [round((marks[start + steps] - marks[start]) * 1e3 / steps, 4)],
            "busy_ms": [round(sum(kinds.values()), 4)], **figures}


def profile_cases(o, tp: int):
    with throughput_engine(o, tp) as (llm, work):
        yield ({"section": "profile", "tp": tp, "requests": len(work)},
               partial(profile_row, llm, work, o.profile_from, o.profile_steps))


# ---------------------------------------------------------------- check

CHECK_MODES = ("resident", "quest_offload")


def check_cases(o):
    shapes = o.check_shapes or ("tiny" if o.smoke else "tiny,qwen3-8b")
    for shape in shapes.split(","):
        for mode in CHECK_MODES:
            yield ({"section": "check", "shape": shape, "mode": mode}, partial(check_row, o, shape, mode))


def check_config(o, shape: str, mode: str, tp: int) -> EngineConfig:
    extra = {}
    if mode == "quest_offload":
        # 64-token budgets of 16-token pages: the longer contexts leave pages out.
        extra = {"offload": True, "kv_block_size": 16,
                 "sparse_policy": QuestPolicy(budget_tokens=64, page_size=16, dense_layers=1)}
    return EngineConfig(model=str(shaped_model(shape, max_positions=2048)), load_format="dummy",
                        tokenizer=o.tokenizer or synthetic_tokenizer(), device=o.device,
                        dtype="float32" if o.device == "cpu" else "bfloat16", max_num_seqs=4,
                        max_model_len=2048, max_num_batched_tokens=4096, tensor_parallel_size=tp,
                        enable_prefix_caching=False, **extra)


def graphs_of(core: EngineCore):
    """The engine's decode graphs; on the CPU (--smoke), where nothing is captured, their
    static programs, run eagerly on every rank."""
    if core.runner.graphs is None and not core.runtime.is_cuda:
        spec = graph_spec(core.config, core.plan, core.runner)
        if core.workers is not None:
            core.workers.install_graphs(spec, core.runner)
        else:
            core.runner.graphs = capture_graphs(spec, core.runner)
    return core.runner.graphs


def check_runs(o, shape: str, mode: str, tp: int, prompts, lengths) -> dict:
    """One engine: greedy eagerly (every rank: rank 0's runner has no graphs), with the top
    two logprobs, then greedy from the graphs; at TP=2, temperature rows from the graphs."""
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    scored = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in lengths]
    with engine_core(check_config(o, shape, mode, tp)) as core:
        graphs = graphs_of(core)
        core.runner.graphs = None
        eager = run_requests(core, "eager", prompts, scored)
        core.runner.graphs = graphs
        steps, inside = graphs.steps, graphs.sampler.sampled_inside
        graphed = run_requests(core, "graphs", prompts, greedy)
        run = {"eager": [[t.token_id for t in row] for row in eager],
               "margins": [top2_margins(row) for row in eager],
               "graphs": [[t.token_id for t in row] for row in graphed],
               "graph_steps": graphs.steps - steps, "sampled_inside": graphs.sampler.sampled_inside - inside}
        if tp > 1:
            hot = [SamplingParams(temperature=0.8, max_tokens=n, ignore_eos=True) for n in lengths]
            inside = graphs.sampler.sampled_inside
            sampled = run_requests(core, "hot", prompts, hot)
            run["temperature_ok"] = ([len(row) for row in sampled] == list(lengths)
                                     and graphs.sampler.sampled_inside > inside)
    del core
    return run


def check_row(o, shape: str, mode: str) -> dict:
    gen = torch.Generator().manual_seed(11)
    n = o.check_prompts
    sizes = [100 + 500 * i // max(n - 1, 1) for i in range(n)][::-1] if not o.smoke else \
        [24 + 16 * i for i in range(n)][::-1]
    prompts = [torch.randint(100, 49152, (size,), generator=gen).tolist() for size in sizes]
    lengths = [4 + 3 * (n - 1 - i) for i in range(n)]     # rows leave one by one
    one = check_runs(o, shape, mode, 1, prompts, lengths)
    two = check_runs(o, shape, mode, 2, prompts, lengths)
    checks = {"tp2_graphs_vs_tp2_eager": agreement(two["eager"], two["margins"], two["graphs"], o.tie),
              "tp2_graphs_vs_tp1_eager": agreement(one["eager"], one["margins"], two["graphs"], o.tie),
              "tp1_graphs_vs_tp1_eager": agreement(one["eager"], one["margins"], one["graphs"], o.tie)}
    ok = (all(c["ok"] for c in checks.values()) and two["graph_steps"] > 0
          and two["sampled_inside"] > 0 and two["temperature_ok"])
    print(f"check {shape} {mode}: {'ok' if ok else 'FAILED'}; TP=2 graph steps {two['graph_steps']} "
          f"(sampled inside {two['sampled_inside']}), temperature rows "
          f"{'ok' if two['temperature_ok'] else 'FAILED'}", flush=True)
    for name, c in checks.items():
        print(f"    {name}: {c['identical']}/{n} identical, parted {c['parts']}", flush=True)
    return {"graph_steps_tp2": two["graph_steps"], "graph_steps_tp1": one["graph_steps"],
            "info": {"ok": ok, **checks, "temperature_ok": two["temperature_ok"],
                     "tp2_graphs": two["graphs"], "tp1_eager": one["eager"]}}


SECTION_CASES = {"decode": decode_cases, "throughput": throughput_cases, "profile": profile_cases,
                 "offload": offload_cases, "quest": quest_cases}


# ---------------------------------------------------------------- the table

def case_name(params: dict) -> str:
    if "requests" in params:
        return f"n={params['requests']}"
    return f"{params['context']}x{params['batch']}"


def summarize(result: dict) -> None:
    """Each figure's median per TP size, the ratio of the largest TP to the smallest, and
    the goal it is held to."""
    table: dict[tuple[str, str], dict[int, dict]] = {}
    for row in result["rows"]:
        p = row["params"]
        if p["section"] in ("check", "faults"):
            continue
        table.setdefault((p["section"], case_name(p)), {})[p["tp"]] = row["figures"]
    sizes = sorted({tp for by_tp in table.values() for tp in by_tp})
    if not sizes:
        return
    low, high = sizes[0], sizes[-1]
    print(f"\nmedians; ratio = TP={high} / TP={low}")
    print(f"{'section':<11}{'case':>11}{'figure':>19}" + "".join(f"{f'TP={tp}':>11}" for tp in sizes)
          + f"{'ratio':>8}  goal")
    for (section, case), by_tp in table.items():
        for figure in TABLE[section]:
            medians = {tp: f[figure]["median"] for tp, f in by_tp.items() if figure in f}
            if not medians:
                continue
            cells = "".join(f"{medians[tp]:>11.4g}" if tp in medians else f"{'-':>11}" for tp in sizes)
            ratio, verdict = "-", ""
            if low in medians and high in medians and low != high and medians[low]:
                value = medians[high] / medians[low]
                ratio = f"{value:.3f}"
                goal = GOALS.get((section, figure))
                if goal is not None:
                    sign, bound = goal
                    met = value <= bound if sign == "<=" else value >= bound
                    verdict = f"{sign} {bound}: {'met' if met else 'MISSED'}"
            print(f"{section:<11}{case:>11}{figure:>19}{cells}{ratio:>8}  {verdict}")
