"""Sparse prefill on the GPU (XAttention, MInference, FlexPrefill): the kernels against their
references, attention time per layer against dense, and end-to-end prefill against Full.

- kernels: the antidiagonal scoring, the block-sparse attention and the vertical-slash
  attention (MInference's default sizes) against the torch references on fresh random bf16 inputs, a whole 8K square and 1K-query chunks after a
  32K / 128K prefix (the engine's chunked-prefill case); error = max |got - ref| / max |ref|.
- attention: one layer of a Qwen3-4B-shaped prompt (32 query / 8 KV heads, head dim 128)
  attended chunk by chunk as the engine does (16K-token chunks, each over its prefix and
  itself): dense (the engine's varlen kernel) against XAttention's scoring, selection and
  sparse attention. Random inputs have no structure, so the cumulative threshold keeps
  about that share of blocks: the thresholds sweep the density. --attention-policies adds
  any prefill policy by its spec (e.g. "flexprefill(gamma=0.9,min_budget=4096)"); a
  FlexPrefill row also times its last chunk's estimate, selection and attention alone.
- estimate: the last chunk of a long prompt (--estimate-prefixes, --estimate-chunk queries
  after them), one layer: XAttention's scoring with its key tiles in one walk per program
  (key_splits=1) and split to fill the GPU, the block selection, the kept-block lists and the
  block-sparse attention at the density of --estimate-threshold, each 3 times (min / median /
  max ms); the two scorings' largest difference relative to the largest score;
  --estimate-tiles times the scoring with other program tiles too.
- e2e: prefill of one prompt on a Qwen3-4B-shaped engine (random weights), Full and
  XAttention (default threshold 0.9; --e2e-thresholds adds lower ones, which on random
  weights keep about a real model's share of blocks), with the density it kept;
  --e2e-policies adds any prefill policy by its spec; --e2e-offload runs each method with
  the KV cache offloaded too (bytes loaded per prefill).

    python benchmarks/sparse_prefill.py                  # GPU -> sparse_prefill.json
    python benchmarks/sparse_prefill.py --smoke          # CPU, tiny sizes: checks the script
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from common import Timer, save, shaped_model, synthetic_tokenizer  # noqa: I001
from astream.base.config import EngineConfig
from astream.base.sampling import SamplingParams
from astream.core.engine_core import EngineCore
from astream.executor.inputs import varlen_meta
from astream.ops import minference as mi
from astream.ops import xattention as xa
from astream.ops.backends import AttentionBackends
from astream.ops.triton_xattention import kept_block_lists
from astream.policies import FlexPrefillPolicy, MInferencePolicy, XAttentionPolicy, make_policy
from astream.policies.spec import split_top_level

HEADS, KV_HEADS, DIM = 32, 8, 128


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    finite = torch.isfinite(ref)
    return float((got.float() - ref)[finite].abs().max() / ref[finite].abs().max().clamp(min=1e-30))


def random_qkv(n_q: int, n_k: int, device, dtype, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    make = lambda n, h: torch.randn(n, h, DIM, generator=gen, device=device, dtype=dtype)  # noqa: E731
    k, v = make(n_k, KV_HEADS), make(n_k, KV_HEADS)
    return make(n_q, HEADS), k, v


def kernel_case(n_q: int, n_k: int, device, dtype, seed: int) -> dict:
    q, k, v = random_qkv(n_q, n_k, device, dtype, seed)
    scale, block, stride = DIM ** -0.5, 128, 8
    scores = xa.antidiagonal_scores(q, k, block=block, stride=stride, scale=scale)
    ref_scores = xa.antidiagonal_scores_ref(q, k, block=block, stride=stride, scale=scale)
    mask = xa.select_blocks_ref(ref_scores, threshold=0.9, n_q=n_q, n_k=n_k, block=block)
    out, lse = xa.block_sparse_attention(q, k, v, mask, block=block, scale=scale)
    ref_out, ref_lse = xa.block_sparse_attention_ref(q, k, v, mask, block=block, scale=scale)
    index = mi.vertical_slash_index(q, k, last_q=64, vertical_size=1000, slash_size=6096, sink=30,
                                    local=100, scale=scale)
    vs_out, vs_lse = mi.vertical_slash_attention(q, k, v, index, block=64, scale=scale)
    vs_ref_out, vs_ref_lse = mi.vertical_slash_attention_ref(q, k, v, index, block=64, scale=scale)
    return {"n_q": n_q, "n_k": n_k, "density": round(xa.density(mask, n_q, n_k, block), 4),
            "scores_err": rel_error(scores, ref_scores), "out_err": rel_error(out, ref_out),
            "lse_err": rel_error(lse, ref_lse), "vertical_slash_out_err": rel_error(vs_out, vs_ref_out),
            "vertical_slash_lse_err": rel_error(vs_lse, vs_ref_lse)}


def chunked_layer(ctx: int, chunk: int, device, dtype, attend) -> float:
    """Seconds for one layer of a `ctx` prompt attended in `chunk`-token chunks by `attend`."""
    q, k, v = random_qkv(ctx, ctx, device, dtype, seed=ctx)
    total = 0.0
    for start in range(0, ctx, chunk):
        end = min(ctx, start + chunk)
        meta = varlen_meta([0, end - start], [0, end], device)
        with Timer() as t:
            attend(q[start:end], k[:end], v[:end], meta)
        total += t.seconds
    return total


def attention_rows(contexts: list[int], chunk: int, thresholds: list[float], device, dtype,
                   repeat: int, slash_sizes: list[int], specs: list[str] = ()) -> list[dict]:
    backends = AttentionBackends.select(device, dtype, DIM)
    dense = lambda q, k, v, m: backends.varlen(q, k, v, m, causal=True, scale=DIM ** -0.5)  # noqa: E731
    rows = []
    for ctx in contexts:
        chunked_layer(min(ctx, chunk), chunk, device, dtype, dense)                 # warm-up
        times = [chunked_layer(ctx, chunk, device, dtype, dense) for _ in range(repeat)]
        rows.append({"context": ctx, "method": "dense", "ms": _spread(times)})
        print(rows[-1], flush=True)
        for threshold in thresholds:
            runtime = XAttentionPolicy(threshold=threshold).bind(_layout(device, dtype))
            rows.append(sparse_row(ctx, chunk, device, dtype, repeat, runtime, f"xattention tau={threshold}"))
            rows[-1].update(parts_ms(ctx, chunk, threshold, device, dtype))
            print(rows[-1], flush=True)
        for slash in slash_sizes:
            runtime = MInferencePolicy(slash_size=slash).bind(_layout(device, dtype))
            rows.append(sparse_row(ctx, chunk, device, dtype, repeat, runtime, f"minference slash={slash}"))
            print(rows[-1], flush=True)
        for spec in specs:
            policy = make_policy(spec)
            rows.append(sparse_row(ctx, chunk, device, dtype, repeat, policy.bind(_layout(device, dtype)), spec))
            if isinstance(policy, FlexPrefillPolicy):
                rows[-1].update(flexprefill_parts_ms(ctx, chunk, policy, device, dtype))
            print(rows[-1], flush=True)
    return rows


def tune_rows(device, dtype, n_q: int, n_k: int, slash: int) -> list[dict]:
    """The vertical-slash kernel's launch settings swept on one chunk (n_q queries after an
    n_k - n_q prefix), each checked against the reference; dense on the same shape first."""
    from astream.ops import triton_minference as tm
    q, k, v = random_qkv(n_q, n_k, device, dtype, seed=7)
    scale = DIM ** -0.5
    backends = AttentionBackends.select(device, dtype, DIM)
    meta = varlen_meta([0, n_q], [0, n_k], device)
    rows = [{"config": "dense", "ms": _timed(lambda: backends.varlen(q, k, v, meta, causal=True, scale=scale))}]
    index = mi.vertical_slash_index(q, k, last_q=64, vertical_size=1000, slash_size=slash, sink=30,
                                    local=100, scale=scale)
    ref_out, _ = mi.vertical_slash_attention_ref(q, k, v, index, block=64, scale=scale)
    layout = mi.vertical_slash_layout(index, n_q, n_k, 64)
    kept, visible = mi.layout_density(layout, n_q, n_k, 64)
    defaults = (tm.BLOCK_N, tm.NUM_WARPS, tm.NUM_STAGES)
    for block_n, warps, stages in [(n, w, s) for n in (32, 64, 128) for w in (4, 8) for s in (1, 2, 3)]:
        tm.BLOCK_N, tm.NUM_WARPS, tm.NUM_STAGES = block_n, warps, stages
        try:
            out, _ = tm.vertical_slash_attention_triton(q, k, v, layout, block=64, scale=scale)
            err = rel_error(out, ref_out)
            ms = _timed(lambda: tm.vertical_slash_attention_triton(q, k, v, layout, block=64, scale=scale))
            rows.append({"config": f"BLOCK_N={block_n} warps={warps} stages={stages}", "ms": ms, "err": err})
        except Exception as exc:     # a setting the compiler refuses (shared memory)
            rows.append({"config": f"BLOCK_N={block_n} warps={warps} stages={stages}", "error": str(exc)[:200]})
        print(rows[-1], flush=True)
    tm.BLOCK_N, tm.NUM_WARPS, tm.NUM_STAGES = defaults
    rows.append({"density": round(float(kept.sum()) / visible, 4)})
    print(rows[-1], flush=True)
    return rows


def _timed(fn, reps: int = 5) -> list[float]:
    fn()
    times = []
    for _ in range(reps):
        with Timer() as t:
            fn()
        times.append(t.seconds)
    return _spread(times)


def sparse_row(ctx, chunk, device, dtype, repeat, runtime, name) -> dict:
    """One layer through a sparse policy's prefill hook, and the density it kept."""
    sparse = lambda q, k, v, m: runtime.prefill_attention(0, q, k, v, m, True, DIM ** -0.5)  # noqa: E731
    chunked_layer(min(ctx, chunk), chunk, device, dtype, sparse)
    runtime.counters.zero_()
    times = [chunked_layer(ctx, chunk, device, dtype, sparse) for _ in range(repeat)]
    kept, visible = runtime.counters[0].tolist()
    return {"context": ctx, "method": name, "ms": _spread(times), "density": round(kept / visible, 4)}


def parts_ms(ctx: int, chunk: int, threshold: float, device, dtype) -> dict:
    """The last chunk's scoring, selection and sparse attention, each timed alone."""
    start = max(0, ctx - chunk)
    q, k, v = random_qkv(ctx, ctx, device, dtype, seed=ctx)
    q, n_q = q[start:], ctx - start
    with Timer() as score_t:
        scores = xa.antidiagonal_scores(q, k, block=128, stride=8, scale=DIM ** -0.5)
    with Timer() as select_t:
        mask = xa.select_blocks_ref(scores, threshold=threshold, n_q=n_q, n_k=ctx, block=128)
        kept_block_lists(mask)
    with Timer() as attend_t:
        xa.block_sparse_attention(q, k, v, mask, block=128, scale=DIM ** -0.5)
    return {"last_chunk_ms": {"score": round(score_t.seconds * 1e3, 2),
                              "select": round(select_t.seconds * 1e3, 2),
                              "attend": round(attend_t.seconds * 1e3, 2)}}


def flexprefill_parts_ms(ctx: int, chunk: int, policy: FlexPrefillPolicy, device, dtype) -> dict:
    """The last chunk's estimate (last block and query-aware scores), selection and sparse
    attention, each timed alone (median of 5)."""
    start, scale, block = max(0, ctx - chunk), DIM ** -0.5, policy.block_size
    q, k, v = random_qkv(ctx, ctx, device, dtype, seed=ctx)
    q, n_q = q[start:], ctx - start
    estimate = lambda: policy.estimate(q, k, scale)                 # noqa: E731
    select = lambda: policy.select(*est, n_q, ctx)[0]               # noqa: E731
    est = estimate()
    mask = select()
    return {"last_chunk_ms": {
        "estimate": _timed(estimate)[1], "select": _timed(select)[1],
        "attend": _timed(lambda: xa.block_sparse_attention(q, k, v, mask, block=block, scale=scale))[1]},
        "last_chunk_density": round(xa.density(mask, n_q, ctx, block), 4)}


def estimate_rows(prefixes: list[int], chunk: int, threshold: float, device, dtype,
                  repeat: int, tile_shapes: list[str]) -> list[dict]:
    rows = []
    for prefix in prefixes:
        rows.append(estimate_row(prefix, chunk, threshold, device, dtype, repeat, tile_shapes))
        print(rows[-1], flush=True)
        if device.type == "cuda":          # the next prefix's inputs, not this one's, in memory
            torch.cuda.empty_cache()
    return rows


def estimate_row(prefix: int, chunk: int, threshold: float, device, dtype, repeat: int,
                 tile_shapes: list[str]) -> dict:
    from astream.ops.triton_xattention_scores import antidiagonal_scores_triton
    scale, block, stride = DIM ** -0.5, 128, 8
    n_k = prefix + chunk
    q, k, v = random_qkv(chunk, n_k, device, dtype, seed=n_k)

    def score(splits=None):
        if device.type != "cuda":
            return xa.antidiagonal_scores(q, k, block=block, stride=stride, scale=scale)
        return antidiagonal_scores_triton(q, k, block=block, stride=stride, scale=scale,
                                          key_splits=splits)
    one, split = score(1), score()
    mask = xa.select_blocks_ref(split, threshold=threshold, n_q=chunk, n_k=n_k, block=block)
    row = {"prefix": prefix, "chunk": chunk, "threshold": threshold,
           "density": round(xa.density(mask, chunk, n_k, block), 4),
           "splits_vs_one_err": rel_error(split, one), "ms": {
               "score_one_walk": _timed(lambda: score(1), repeat),
               "score_split": _timed(score, repeat),
               "select": _timed(lambda: xa.select_blocks_ref(
                   split, threshold=threshold, n_q=chunk, n_k=n_k, block=block), repeat),
               "kept_lists": _timed(lambda: kept_block_lists(mask), repeat),
               "attend": _timed(lambda: xa.block_sparse_attention(q, k, v, mask, block=block,
                                                                  scale=scale), repeat)}}
    for tiles in tile_shapes:
        row["ms"][f"score_split_{tiles}"] = _with_tiles(tiles, lambda: _timed(score, repeat))
    return row


def _with_tiles(tiles: str, fn):
    """fn() with the scoring kernel's program tile set to QGxKG stride-groups."""
    from astream.ops import triton_xattention_scores as kernels
    saved = kernels.QUERY_GROUPS, kernels.KEY_GROUPS
    kernels.QUERY_GROUPS, kernels.KEY_GROUPS = (int(x) for x in tiles.split("x"))
    try:
        return fn()
    finally:
        kernels.QUERY_GROUPS, kernels.KEY_GROUPS = saved


def _layout(device, dtype):
    from astream.policies import KVLayout
    return KVLayout(1, HEADS, KV_HEADS, DIM, 1, 16, dtype, device, offload=False, key_dtype=dtype,
                    max_num_seqs=1)


def _spread(seconds: list[float]) -> list[float]:
    ordered = sorted(s * 1e3 for s in seconds)
    return [round(ordered[0], 2), round(ordered[len(ordered) // 2], 2), round(ordered[-1], 2)]


def e2e_rows(contexts: list[int], args, device) -> list[dict]:
    folder = shaped_model("tiny" if args.smoke else "qwen3-4b", max(contexts) + 64)
    rows = []
    methods = [] if args.e2e_skip_full else [("full", "full")]
    methods += [(f"xattention tau={t}", XAttentionPolicy(threshold=t))
                                    for t in args.e2e_thresholds]
    methods += [(f"minference slash={s}", MInferencePolicy(slash_size=s)) for s in args.e2e_minference_slash]
    methods += [(spec, make_policy(spec)) for spec in args.e2e_policies]
    modes = ["resident", "offload"] if args.e2e_offload else ["resident"]
    for (name, policy), mode in [(m, mode) for m in methods for mode in modes]:
        config = EngineConfig(model=str(folder), load_format="dummy", tokenizer=args.tokenizer or synthetic_tokenizer(),
                              device=device.type, dtype="float32" if args.smoke else "bfloat16",
                              max_num_seqs=1, max_model_len=max(contexts) + 64, sparse_policy=policy,
                              max_num_batched_tokens=args.chunk, offload=mode == "offload")
        core = EngineCore.create(config)
        for ctx in contexts:
            if hasattr(core.runner.policy, "counters"):     # density of this context alone
                core.runner.policy.counters.zero_()
            before = core.stats().get("offload_bytes_loaded", 0)
            runs = [prefill_seconds(core, ctx, seed) for seed in range(args.repeat)]
            times, tokens = [t for t, _ in runs], [token.token_id for _, token in runs]
            density = next((v for k, v in core.stats().items() if k.endswith("_density")), None)
            loaded = (core.stats().get("offload_bytes_loaded", 0) - before) / args.repeat
            rows.append({"context": ctx, "method": name, "mode": mode,
                         "prefill_s": [round(t, 3) for t in sorted(times)],
                         "tok_s_median": round(ctx / sorted(times)[len(times) // 2]),
                         "gb_loaded_per_prefill": round(loaded / 1e9, 2), "first_tokens": tokens,
                         "density_by_layer": density})
            print({k: v for k, v in rows[-1].items() if k != "density_by_layer"}, flush=True)
        if mode == "offload":
            resident = {r["context"]: r for r in rows if r["method"] == name and r["mode"] == "resident"}
            for row in rows[-len(contexts):]:
                same = resident.get(row["context"])
                if same is not None:
                    row["same_as_resident"] = (row["first_tokens"] == same["first_tokens"]
                                               and row["density_by_layer"] == same["density_by_layer"])
                    print(f"{name} {row['context']}: offload and resident agree (first tokens, "
                          f"density of every layer): {row['same_as_resident']}", flush=True)
        core.close()
        del core                     # the next engine sizes its cache from free memory
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def prefill_seconds(core: EngineCore, ctx: int, seed: int) -> tuple[float, int]:
    # A prompt of its own per context: no shared prefix for the prefix cache to reuse.
    gen = torch.Generator().manual_seed(seed * 1_000_003 + ctx)
    prompt = torch.randint(100, 49152, (ctx,), generator=gen).tolist()
    core.runtime.synchronize()
    start = time.perf_counter()
    sink = core.add_request(f"p{ctx}-{seed}", prompt, SamplingParams(temperature=0, max_tokens=1))
    while not sink.tokens:
        core.step()
    core.runtime.synchronize()
    return time.perf_counter() - start, sink.tokens[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--sections", default="kernels,attention,e2e")
    parser.add_argument("--contexts", default="32768,65536,131072")
    parser.add_argument("--thresholds", default="0.9,0.5,0.2,0.1")
    parser.add_argument("--e2e-thresholds", default="0.9",
                        help="XAttention thresholds of the e2e section (random weights keep about "
                             "that share of blocks: a lower one stands for a real model's density)")
    parser.add_argument("--e2e-offload", action="store_true",
                        help="run each e2e method with the KV cache offloaded too")
    parser.add_argument("--e2e-skip-full", action="store_true", help="leave Full out of the e2e section")
    parser.add_argument("--minference-slash", default="6096",
                        help="MInference diagonal counts of the attention section (at 128K; scaled "
                             "with length): fewer stand for a real model's clustered diagonals")
    parser.add_argument("--tune-slash", type=int, default=500)
    parser.add_argument("--attention-policies", default="",
                        help="attention: more prefill policies by spec, comma-separated, e.g. "
                             "'flexprefill,flexprefill(gamma=0.9,min_budget=4096)'")
    parser.add_argument("--e2e-policies", default="",
                        help="e2e: more prefill policies by spec, comma-separated")
    parser.add_argument("--e2e-minference-slash", default="",
                        help="MInference diagonal counts of the e2e section (none by default)")
    parser.add_argument("--estimate-prefixes", default="131072,262144,524288,1015808",
                        help="estimate: the prefixes before the timed chunk")
    parser.add_argument("--estimate-chunk", type=int, default=32768)
    parser.add_argument("--estimate-threshold", type=float, default=0.15,
                        help="estimate: random inputs keep about this share of blocks")
    parser.add_argument("--estimate-tiles", default="",
                        help="estimate: scoring tiles to time besides the default, QGxKG "
                             "stride-groups a program, e.g. 128x128,64x128")
    parser.add_argument("--chunk", type=int, default=16384)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tokenizer", default=None)
    args = parser.parse_args()
    args.e2e_thresholds = [float(t) for t in args.e2e_thresholds.split(",") if t]
    args.e2e_minference_slash = [int(s) for s in args.e2e_minference_slash.split(",") if s]
    args.attention_policies, args.e2e_policies = (
        [spec.strip() for spec in split_top_level(text, ",") if spec.strip()]
        for text in (args.attention_policies, args.e2e_policies))
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    contexts = [512, 1024] if args.smoke else [int(c) for c in args.contexts.split(",")]
    if args.smoke:
        args.chunk = 256
    sections, result = args.sections.split(","), {"chunk": args.chunk}
    torch.set_grad_enabled(False)
    if "kernels" in sections:
        cases = [(256, 256), (64, 1024)] if args.smoke else [(8192, 8192), (1024, 32768), (1024, 131072)]
        result["kernels"] = [kernel_case(n_q, n_k, device, dtype, seed) for seed, (n_q, n_k) in enumerate(cases)]
        for row in result["kernels"]:
            print(row, flush=True)
    if "attention" in sections:
        result["attention"] = attention_rows(contexts, args.chunk,
                                             [float(t) for t in args.thresholds.split(",") if t],
                                             device, dtype, args.repeat,
                                             [int(s) for s in args.minference_slash.split(",") if s],
                                             args.attention_policies)
    if "tune" in sections:
        n_q, n_k = (256, 1024) if args.smoke else (16384, 32768)
        result["tune"] = tune_rows(device, dtype, n_q, n_k, 100 if args.smoke else args.tune_slash)
    if "estimate" in sections:
        prefixes = [768] if args.smoke else [int(p) for p in args.estimate_prefixes.split(",")]
        result["estimate"] = estimate_rows(prefixes, 256 if args.smoke else args.estimate_chunk,
                                           args.estimate_threshold, device, dtype, args.repeat,
                                           [t for t in args.estimate_tiles.split(",") if t])
    if "e2e" in sections:
        result["e2e"] = e2e_rows(contexts, args, device)
    save("sparse_prefill", result, smoke=args.smoke)


if __name__ == "__main__":
    main()
