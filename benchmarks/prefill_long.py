"""One long prompt prefilled by the engine: seconds, per-chunk times, PCIe, memory, density.

    python benchmarks/run.py prefill_long --section one --ctx 262144 [options]   # --smoke: CPU, tiny
    python benchmarks/run.py prefill_long --section fit --inputs A.json,B.json [--target 1048576]

Sections:

- `one` [default]: an engine of the Qwen3-4B shape (random weights, bf16) with
  max_model_len = the largest --ctx, offloaded (--resident: not), KV --kv-dtype [fp8_e4m3],
  --policy a sparse_policy spec [quest: Full prefill, Quest decode; e.g.
  "xattention(threshold=0.9)+quest" for a sparse prefill], --chunk tokens a step [16384].
  Each context of --ctx (a list) prefills one fresh random prompt of ctx - 1 tokens (a
  prompt and its first token fit in max_model_len) after a warm-up prompt of two chunks.
  Every step is synchronous (EngineCore.step), so each chunk's time is its whole latency;
  one line is printed per --print-every chunks as it goes. A prefill still running after
  --max-seconds [540] is aborted: its row says so (`complete` False, `prefilled` tokens),
  so a device command under its 10-minute limit still reports what it measured.
  Figures: `seconds` (the prompt's first token out), `tok_s`, `chunk_s` (one value a
  chunk), `h2d_gb` (bytes the offload engine loaded during the prefill: ring slots, or
  whole prefixes for a sparse prefill), `h2d_gbps` (those bytes over the prefill's time:
  the link's mean use; PCIe moves 55 GB/s one way), `peak_device_gib` (torch's peak
  allocation during the prefill), `device_used_gib`; with a sparse prefill policy
  `density` (the share of causally visible blocks, or keys for MInference, its estimate
  kept, over every layer; the dense tail not counted). Info: the memory plan, pinned host
  GiB, the pool's allocation time, engine start seconds, the kernels, the last chunks'
  times, the density per layer.
- `fit`: reads earlier result files of `one` (--inputs, comma-separated paths) and fits
  t(L) = a + b L + c L^2 to their complete rows (least squares; with two contexts, a = 0),
  and prints it with its value at --target [1048576] tokens. No device needed.

A tokenizer is needed only to build the engine and to decode the one token sampled (the
prompt is token ids): --tokenizer DIR, else one built here with no file
(common.synthetic_tokenizer: token i is "t<i>"), so a device command carries nothing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterator

import torch

from common import engine_core, shaped_model, synthetic_tokenizer  # noqa: I001
from astream.base.config import EngineConfig
from astream.base.outputs import Progress
from astream.base.sampling import SamplingParams

SECTIONS = ("one", "fit")
GiB = 2**30
DENSITY_KEYS = ("xattention_blocks", "minference_keys", "flexprefill_blocks")
DEFAULTS = dict(ctx="262144", chunk=16384, policy="quest", kv_dtype="fp8_e4m3", shape="qwen3-4b",
                max_seconds=540.0, print_every=8)
# The tiny shape's 2 layers: one dense Quest layer on the device, one offloaded.
SMOKE = dict(ctx="1024,2048", chunk=256, policy="xattention(threshold=0.9)+quest(dense_layers=1)",
             kv_dtype="fp8_e4m3", shape="tiny", max_seconds=300.0, print_every=4)


def add_arguments(parser) -> None:
    parser.add_argument("--section", default="one", choices=SECTIONS)
    parser.add_argument("--ctx", default=None, help="one: context tokens, a list (one row each)")
    parser.add_argument("--chunk", type=int, default=None, help="one: prefill tokens a step")
    parser.add_argument("--policy", default=None, help="one: a sparse_policy spec (quest: Full prefill)")
    parser.add_argument("--kv-dtype", default=None, help="one: kv_cache_dtype (auto: the model's)")
    parser.add_argument("--resident", action="store_true", help="one: KV on the device, no offload")
    parser.add_argument("--shape", default=None, help="one: a model shape of common.SHAPES")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="one: abort a prefill still running after this long")
    parser.add_argument("--print-every", type=int, default=None, help="one: chunks between lines")
    parser.add_argument("--tokenizer", default=None,
                        help="a tokenizer folder (default: common.synthetic_tokenizer())")
    parser.add_argument("--inputs", default=None, help="fit: result files of `one`, comma-separated")
    parser.add_argument("--target", type=int, default=1 << 20, help="fit: the context to extrapolate to")


def cases(options) -> Iterator[tuple[dict, object]]:
    for key, value in (SMOKE if options.smoke else DEFAULTS).items():
        if getattr(options, key) is None:
            setattr(options, key, value)
    return fit_cases(options) if options.section == "fit" else one_cases(options)


# ---------------------------------------------------------------- one prompt, prefilled

def engine_config(o, max_len: int) -> EngineConfig:
    tiny = o.shape in ("tiny", "micro")
    return EngineConfig(
        model=str(shaped_model(o.shape, max_positions=max_len)), load_format="dummy",
        tokenizer=o.tokenizer or synthetic_tokenizer(), device=o.device,
        dtype="float32" if o.device == "cpu" else "bfloat16", offload=not o.resident,
        kv_cache_dtype=o.kv_dtype, max_num_seqs=1, max_model_len=max_len,
        max_num_batched_tokens=o.chunk, sparse_policy=o.policy or "full", enforce_eager=True,
        **({"kv_block_size": 64} if tiny else {}))


def density_counts(stats: dict) -> tuple[int, int] | None:
    """(read, visible) summed over layers from the sparse prefill policy's stats, if any."""
    for key in DENSITY_KEYS:
        if key in stats:
            return tuple(stats[key])
    return None


def per_layer_density(stats: dict) -> list | None:
    for key in ("xattention_density", "minference_density", "flexprefill_density"):
        if key in stats:
            return stats[key]
    return None


def memory_info(core, engine_s: float) -> dict:
    """The memory plan, and what was measured: host memory pinned, how long pinning took."""
    memory = core.plan.memory
    info = {"plan": memory.describe(), "plan_device_gib": round(memory.device_total / GiB, 2),
            "engine_s": round(engine_s, 2), "kernels": kernels(core.runner.backends)}
    engine = core.runner.offload
    if engine is not None:
        pool = engine.host_pool
        info.update(host_pinned_gib=round(pool.nbytes / GiB, 2) if pool.pieces else 0.0,
                    pool_pieces=pool.pieces, pool_alloc_s=round(pool.seconds, 2),
                    ring_slots=len(engine.slots), slot_tokens=engine.slot_blocks * engine.block_size,
                    device_layers=sorted(engine.device_layers))
    return info


def kernels(backends) -> str:
    return f"{backends.varlen_name}, {backends.decode_name}" + (", cudnn" if backends.cudnn_prefill else "")


def prefilled(sink, n: int) -> int:
    """Prompt tokens prefilled so far, from the request's progress items (all, once a token is out)."""
    if sink.tokens:
        return n
    return next((item.prefilled for item in reversed(sink.items) if isinstance(item, Progress)), 0)


def prompt_ids(n: int, seed: int) -> list[int]:
    return torch.randint(100, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill_row(core, ctx: int, seed: int, o, info: dict) -> dict:
    """Prefill one prompt of ctx - 1 tokens (to its first token), a synchronous step a chunk."""
    n = ctx - 1
    engine, cuda = core.runner.offload, core.runtime.is_cuda
    before_loaded = engine.bytes_loaded if engine is not None else 0
    before = density_counts(core.stats())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    core.runtime.synchronize()
    request_id = f"long{seed}"
    start = time.perf_counter()
    sink = core.add_request(request_id, prompt_ids(n, seed), SamplingParams(max_tokens=1, ignore_eos=True))
    chunks, done, complete = [], 0, True
    while not sink.tokens:
        t0 = time.perf_counter()
        core.step()
        chunks.append(time.perf_counter() - t0)
        done = prefilled(sink, n)
        elapsed = time.perf_counter() - start
        if len(chunks) % o.print_every == 0 or sink.tokens:
            loaded = (engine.bytes_loaded - before_loaded) / 1e9 if engine is not None else 0.0
            print(f"    ctx {ctx}: {done}/{n} tokens, {elapsed:.1f} s, last chunk {chunks[-1]:.2f} s, "
                  f"H2D {loaded:.1f} GB", flush=True)
        if not sink.tokens and elapsed > o.max_seconds:
            complete = False
            break
    seconds = time.perf_counter() - start
    loaded = (engine.bytes_loaded - before_loaded) if engine is not None else 0
    row = {"seconds": seconds, "tok_s": done / seconds, "chunk_s": chunks,
           "h2d_gb": loaded / 1e9, "h2d_gbps": loaded / 1e9 / seconds}
    if cuda:
        free, total = torch.cuda.mem_get_info(core.runtime.device)
        row.update(peak_device_gib=torch.cuda.max_memory_allocated() / GiB,
                   device_used_gib=(total - free) / GiB)
    stats = core.stats()
    after = density_counts(stats)
    extra = {}
    if after is not None:
        read, visible = (a - b for a, b in zip(after, before))
        if visible:
            row["density"] = read / visible
        extra["density_by_layer_cumulative"] = per_layer_density(stats)
    if not complete:
        core.abort(request_id)
    while core.step():
        pass
    row["info"] = {**info, **extra, "complete": complete, "prefilled": done, "prompt_tokens": n,
                   "chunks": len(chunks), "last_chunks_s": [round(c, 3) for c in chunks[-4:]]}
    return row


def one_cases(o):
    contexts = [int(c) for c in o.ctx.split(",")]
    max_len = max(contexts)
    start = time.perf_counter()
    with engine_core(engine_config(o, max_len)) as core:
        info = memory_info(core, time.perf_counter() - start)
        print(f"    memory plan: {info['plan']}", flush=True)
        warm = prompt_ids(min(2 * o.chunk, max_len - 1), seed=0)    # first-use costs, compiles
        sink = core.add_request("warm", warm, SamplingParams(max_tokens=1, ignore_eos=True))
        while not sink.tokens:
            core.step()
        while core.step():
            pass
        for i, ctx in enumerate(contexts):
            yield ({"ctx": ctx, "policy": o.policy, "kv": o.kv_dtype, "offload": not o.resident,
                    "chunk": o.chunk, "shape": o.shape},
                   lambda ctx=ctx, i=i: prefill_row(core, ctx, 1 + i, o, dict(info)))


# ---------------------------------------------------------------- the quadratic fit

def read_points(paths: list[str]) -> list[tuple[int, float, dict]]:
    """(context, seconds, params) of every complete row of `one` in the files."""
    points = []
    for path in paths:
        result = json.loads(Path(path).read_text())
        for row in result["rows"]:
            if "ctx" not in row["params"] or not row["info"].get("complete", False):
                continue
            points.append((row["params"]["ctx"], row["figures"]["seconds"]["median"], row["params"]))
    return sorted(points, key=lambda p: p[0])


def quadratic_fit(lengths: list[int], seconds: list[float]) -> tuple[float, float, float]:
    """(a, b, c) of t = a + b L + c L^2, least squares; with two points a = 0."""
    L = torch.tensor(lengths, dtype=torch.float64)
    t = torch.tensor(seconds, dtype=torch.float64).view(-1, 1)
    columns = [L, L * L] if len(lengths) < 3 else [torch.ones_like(L), L, L * L]
    solution = torch.linalg.lstsq(torch.stack(columns, 1), t).solution.view(-1).tolist()
    return tuple([0.0] * (3 - len(solution)) + solution)


def fit_row(o) -> dict:
    points = read_points([p for p in (o.inputs or "").split(",") if p])
    if len(points) < 2:
        raise SystemExit(f"fit: need complete rows of two contexts or more, got {len(points)}")
    lengths, seconds = [p[0] for p in points], [p[1] for p in points]
    a, b, c = quadratic_fit(lengths, seconds)
    at_target = a + b * o.target + c * o.target ** 2
    print(f"    t(L) = {a:.4g} + {b:.4g} L + {c:.4g} L^2 seconds, from "
          + ", ".join(f"{L}: {s:.1f} s" for L, s in zip(lengths, seconds)), flush=True)
    print(f"    t({o.target}) = {at_target:.1f} s ({at_target / 60:.1f} min)", flush=True)
    residual = max(abs(a + b * L + c * L * L - s) for L, s in zip(lengths, seconds))
    return {"a": a, "b": b, "c": c, "seconds_at_target": at_target, "max_residual_s": residual,
            "info": {"points": [[L, s] for L, s in zip(lengths, seconds)],
                     "policies": sorted({str(p[2].get("policy")) for p in points}),
                     "quadratic_share_at_target": c * o.target ** 2 / at_target if at_target else None}}


def fit_cases(o):
    yield {"fit": "t = a + b L + c L^2", "target": o.target}, lambda: fit_row(o)


def summarize(result: dict) -> None:
    rows = [r for r in result["rows"] if "ctx" in r["params"]]
    if not rows:
        return
    print(f"{'ctx':>9} {'policy':<34} {'s':>8} {'tok/s':>8} {'H2D GB':>8} {'GB/s':>6} "
          f"{'peak GiB':>8} {'density':>8}")
    for row in rows:
        f, p = row["figures"], row["params"]

        def med(name):
            return f[name]["median"] if name in f else float("nan")
        done = "" if row["info"].get("complete", True) else f"  (aborted at {row['info']['prefilled']})"
        print(f"{p['ctx']:>9} {str(p['policy'])[:34]:<34} {med('seconds'):>8.1f} {med('tok_s'):>8.0f} "
              f"{med('h2d_gb'):>8.1f} {med('h2d_gbps'):>6.1f} {med('peak_device_gib'):>8.2f} "
              f"{med('density'):>8.3f}{done}")
