"""What astream's sparse policies select against what the authors' reference code selects,
on the same post-RoPE Q and K captured from a real model.

The references are fetched separately and given by path; nothing of theirs is copied here.
Their own Python runs wherever it can on the device at hand:

- Quest (mit-han-lab/Quest): `forward` of evaluation/quest_attention.py (the code behind the
  paper's accuracy results) runs on a stand-in attention module whose projections return
  the captured tensors; its `local_heavy_hitter_mask` is wrapped to record the chunks it
  keeps. The deployed CUDA path (quest/utils/controller.py, decode_estimate / decode_topk)
  is restated in `quest_kernel_rule` below.
- MInference (microsoft/MInference): `minference_prefill_kernel` and `sum_all_diagonal_matrix`
  of minference/modules/minference_forward.py, their source taken with `ast` and run with
  CPU-side globals (the module builds a CUDA mask at import); the sparse kernel it ends in
  is replaced by a recorder of the vertical and slash indices it is given.
- XAttention (mit-han-lab/x-attention): `Xattention_prefill` of xattn/src/Xattention.py (its
  torch path; `--xattn-triton` takes its Triton path on a GPU), with `block_sparse_attn_func`
  replaced by a recorder of the block mask.
- FlexPrefill (bytedance/FlexPrefill): `flex_prefill_attention` and `get_active_blocks` of
  flex_prefill/ops/flex_prefill_attention.py with their helpers, their source taken with
  `ast` and run with CPU-side globals: its Triton average pool is a torch stand-in, its
  block-sparse and dense kernels recorders of the block indices they are given, and its
  intermediates (counts, block sums, JS distances, query-aware scores) are recorded as
  they pass. `flexprefill_reference_rule` restates its selection from those block scores.

Agreement is the Jaccard index |A & B| / |A | B| of the selected pages / columns / diagonals
/ blocks, per layer and query head (astream selects Quest pages per KV head: each query head
is compared with its KV head's selection). A method is skipped with `--skip`; its reference
is needed otherwise.

    python benchmarks/sparse_reference.py --quest-ref Q --minference-ref M --xattention-ref X \\
        --skip flexprefill --out benchmarks/results/sparse_reference_smollm2_2k.json   # CPU, 2K
    python benchmarks/sparse_reference.py --flexprefill-ref F --skip quest,minference,xattention \\
        --out benchmarks/results/sparse_prefill/flexprefill_reference_smollm2_2k.json
    python benchmarks/sparse_reference.py ... --model /tmp/qwen25coder05b.gguf --device cuda \\
        --dtype bfloat16 --prompt-len 16384 --out $OUT/sparse_reference_qwen_16k.json
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import math
import statistics
import sys
import types
from contextlib import contextmanager
from pathlib import Path

import torch

from common import ROOT, device_name, smollm2  # noqa: I001
from astream import LLM
from astream.ops import flexprefill as fp_ops
from astream.ops import minference as vs_ops
from astream.ops import quest as quest_ops
from astream.ops import xattention as xattn_ops
from astream.ops.attention import VarlenMeta, varlen_attention
from astream.ops.quest_select import select_decode_pages_ref
from astream.policies.base import DecodeQuery, KVLayout, StepShape
from astream.policies.flexprefill import FlexPrefillPolicy
from astream.policies.minference import MInferencePolicy
from astream.policies.quest import QuestPolicy
from astream.policies.xattention import XAttentionPolicy


# ---------------------------------------------------------------- capture

def prompt_ids(llm: LLM, tokens: int) -> list[int]:
    """`tokens` ids of natural text: this repository's docs, repeated if they are short."""
    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = llm.tokenizer.encode(text)
    while len(ids) < tokens:
        ids = ids + ids
    return ids[:tokens]


def capture(llm: LLM, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, post-RoPE q [T, H, D] and k [T, KVH, D] of one exact causal prefill."""
    decoder = llm.core.model.decoder
    n, device = len(ids), decoder.device
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    meta = VarlenMeta(cu, cu, n, n, [0, n], [0, n])
    layers = []

    def attend(layer, q, k, v):
        layers.append((q.clone(), k.clone()))
        return varlen_attention(q, k, v, meta, causal=True, scale=decoder.config.head_dim ** -0.5)[0]

    with torch.inference_mode():
        decoder.forward(torch.tensor(ids, device=device), torch.arange(n, device=device), attend)
    return layers


# ---------------------------------------------------------------- agreement

def jaccard(a: set, b: set) -> float:
    return 1.0 if not a and not b else len(a & b) / len(a | b)


def summary(values: list[float]) -> dict:
    return {"min": round(min(values), 4), "median": round(statistics.median(values), 4),
            "mean": round(statistics.fmean(values), 4)}


def table(per_layer: dict[int, list[float]]) -> dict:
    """per_layer {layer: [jaccard per head (and query)]} -> per-layer and overall summaries."""
    every = [x for xs in per_layer.values() for x in xs]
    return {"per_layer": {str(layer): summary(xs) for layer, xs in sorted(per_layer.items())},
            "overall": summary(every), "n": len(every)}


def load_source_functions(path: Path, names: list[str], namespace: dict) -> dict:
    """Run the top-level functions `names` of the file at `path` in `namespace` (their own
    text, without the rest of the module)."""
    tree = ast.parse(path.read_text())
    wanted = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    missing = set(names) - {node.name for node in wanted}
    if missing:
        raise SystemExit(f"{path}: no top-level function {sorted(missing)}")
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


@contextmanager
def cuda_to_is_noop():
    """The references move tensors with .to("cuda"); without a GPU that is a no-op here."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.to

    def to(self, *args, **kwargs):
        if args and isinstance(args[0], (str, torch.device)) and str(args[0]).startswith("cuda"):
            args = ("cpu", *args[1:])
        return original(self, *args, **kwargs)

    torch.Tensor.to = to
    try:
        yield
    finally:
        torch.Tensor.to = original


# ---------------------------------------------------------------- Quest

def load_quest_reference(root: Path):
    spec = importlib.util.spec_from_file_location("quest_reference_eval",
                                                  root / "evaluation" / "quest_attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # The captured q and k already carry RoPE; transformers >= 5 also dropped the position_ids
    # argument the module passes, so its rotation becomes the identity here.
    module.apply_rotary_pos_emb = lambda q, k, *args, **kwargs: (q, k)
    return module


def quest_reference_pages(module, q: torch.Tensor, k: torch.Tensor, t: int, layer: int,
                          budget: int, chunk: int) -> list[set[int]]:
    """The pages (chunks) Quest's evaluation forward keeps for the decode query at position t,
    per query head: q [H, D] of position t, k [t+1, KVH, D]."""
    n_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    kept = []
    original = module.local_heavy_hitter_mask

    def record(weights, token_budget, chunk_size):
        mask = original(weights, token_budget, chunk_size)
        kept.append(mask)
        return mask

    past = k[:t].permute(1, 0, 2).unsqueeze(0)                      # [1, KVH, t, D]
    fake = types.SimpleNamespace(
        num_heads=n_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        hidden_size=n_heads * head_dim, num_key_value_groups=n_heads // kv_heads,
        layer_id=layer, token_budget=budget, chunk_size=chunk,
        q_proj=lambda h: q.reshape(1, 1, -1), k_proj=lambda h: k[t].reshape(1, 1, -1),
        v_proj=lambda h: torch.zeros(1, 1, kv_heads * head_dim, dtype=k.dtype, device=k.device),
        o_proj=lambda x: x, rotary_emb=lambda v, pos: (None, None))
    module.local_heavy_hitter_mask = record
    try:
        module.forward(fake, torch.zeros(1, 1, 1, dtype=q.dtype, device=q.device),
                       attention_mask=None,
                       position_ids=torch.tensor([[t]], device=q.device),
                       past_key_value=(past, torch.zeros_like(past)), output_attentions=False,
                       use_cache=False)
    finally:
        module.local_heavy_hitter_mask = original
    mask = kept[0][0, :, 0, :t + 1]                                # [H, t+1]
    return [set((mask[h].nonzero().flatten() // chunk).tolist()) for h in range(n_heads)]


def quest_kernel_rule(q: torch.Tensor, k: torch.Tensor, t: int, budget: int,
                      page_size: int) -> list[set[int]]:
    """The reference's rule, restated: Quest's deployed CUDA path (quest/utils/controller.py
    `InferenceController.begin_forward` / `need_estimate`, quest/utils/__init__.py
    `decode_estimate` and `decode_topk`). Per (query) head, with P = ceil((t+1)/page_size)
    pages and B = min(budget // page_size, P): if P <= B every page; else the last page
    (the one holding t) and the top B - 1 of the others by sum_i max(q_i min_i, q_i max_i)."""
    n_pages = -(-(t + 1) // page_size)
    budget_pages = min(budget // page_size, n_pages)
    if n_pages <= budget_pages:
        return [set(range(n_pages))] * q.shape[0]
    keys = k[:t + 1].float().repeat_interleave(q.shape[0] // k.shape[1], dim=1)     # [T, H, D]
    pad = n_pages * page_size - (t + 1)
    lo = torch.nn.functional.pad(keys, (0, 0, 0, 0, 0, pad), value=float("inf"))
    hi = torch.nn.functional.pad(keys, (0, 0, 0, 0, 0, pad), value=float("-inf"))
    kmin = lo.unflatten(0, (n_pages, page_size)).amin(1)                           # [P, H, D]
    kmax = hi.unflatten(0, (n_pages, page_size)).amax(1)
    qf = q.float().unsqueeze(0)
    scores = torch.maximum(qf * kmin, qf * kmax).sum(-1)[:-1]                       # [P-1, H]
    top = scores.topk(budget_pages - 1, dim=0).indices                              # [B-1, H]
    return [set(top[:, h].tolist()) | {n_pages - 1} for h in range(q.shape[0])]


def astream_quest_pages(runtime, layer: int, q: torch.Tensor, t: int, block_size: int,
                        n_blocks: int) -> list[set[int]]:
    """What the engine's resident decode path selects for the query at position t, per KV
    head: pages of the full blocks by the policy, and the newest block whole (clipped to the
    pages that hold tokens <= t)."""
    policy = runtime.policy
    context = t + 1
    n_pages = -(-context // policy.page_size)
    if layer not in runtime.plan_step(StepShape(1, context)).select_layers:
        return [set(range(n_pages))] * runtime.layout.num_kv_heads
    tables = torch.arange(n_blocks, dtype=torch.int32, device=q.device).view(1, -1)
    full = torch.tensor([t // block_size * block_size], dtype=torch.int32, device=q.device)
    chosen = runtime.select_decode(layer, DecodeQuery(q.unsqueeze(0), tables, full, context,
                                                      append_newest=True))
    indices, counts = chosen.indices[0].cpu(), chosen.counts[0].cpu()
    return [set(p for p in indices[h, :counts[h]].tolist() if p < n_pages)
            for h in range(indices.shape[0])]


def astream_rule_per_query_head(q: torch.Tensor, k: torch.Tensor, t: int, budget: int,
                                page_size: int, sink: int, recent: int) -> list[set[int]]:
    """astream's selection op on one query head at a time (each its own KV head) over the
    keys 0..t, without the newest-block read: the rule alone, as the reference applies it."""
    n_heads = q.shape[0]
    group = n_heads // k.shape[1]
    context = t + 1
    n_pages = -(-context // page_size)
    keys = k[:context].repeat_interleave(group, dim=1)
    blocks = torch.nn.functional.pad(keys, (0, 0, 0, 0, 0, n_pages * page_size - context))
    kmin, kmax = quest_ops.bounds_of_blocks(
        blocks.view(n_pages, page_size, n_heads, -1), page_size,
        torch.tensor([page_size] * (n_pages - 1) + [context - (n_pages - 1) * page_size],
                     device=q.device))
    tables = torch.arange(n_pages, dtype=torch.int32, device=q.device).view(1, -1)
    chosen = select_decode_pages_ref(
        q.unsqueeze(0), kmin, kmax, tables, torch.tensor([context], device=q.device),
        max_pages=n_pages, block_size=page_size, page_size=page_size,
        budget_pages=max(budget // page_size, sink + recent, 1), sink_pages=sink,
        recent_pages=recent, gqa_reduce="max")
    indices, counts = chosen.indices[0].cpu(), chosen.counts[0].cpu()
    return [set(indices[h, :counts[h]].tolist()) for h in range(n_heads)]


def compare_quest(args, layers, model_dtype, device) -> dict:
    module = load_quest_reference(Path(args.quest_ref))
    n = layers[0][0].shape[0]
    n_heads, kv_heads, head_dim = layers[0][0].shape[1], layers[0][1].shape[1], layers[0][0].shape[2]
    group = n_heads // kv_heads
    positions = sorted({round(n // 2 + i * (n - 1 - n // 2) / max(1, args.quest_queries - 1))
                        for i in range(args.quest_queries)})
    block = args.kv_block_size
    n_blocks = -(-n // block)
    out = {"query_positions": positions, "kv_block_size": block}
    for budget in args.quest_budgets:
        # `max`, as the figures in docs/BENCHMARKS.md were taken; `sum` below beside it.
        policy = QuestPolicy(budget_tokens=budget, gqa_reduce="max")
        layout = KVLayout(len(layers), n_heads, kv_heads, head_dim, n_blocks, block, model_dtype,
                          torch.device(device), False, model_dtype, max_num_seqs=1)
        runtime = policy.bind(layout)
        summed = QuestPolicy(budget_tokens=budget, gqa_reduce="sum").bind(layout)
        rows = {name: {} for name in ("astream_vs_eval", "astream_recall_of_eval", "astream_vs_kernel",
                                      "astream_gqa_sum_vs_eval", "astream_per_query_head_vs_eval",
                                      "astream_rule_no_forced_vs_eval", "eval_vs_kernel")}
        pages_read = {"astream": [], "eval": [], "kernel": []}
        for layer, (q, k) in enumerate(layers):
            if layer < policy.dense_layers:
                continue
            runtime.on_kv_written(layer, k, torch.arange(n, device=k.device))
            summed.on_kv_written(layer, k, torch.arange(n, device=k.device))
            for t in positions:
                ours = astream_quest_pages(runtime, layer, q[t], t, block, n_blocks)
                ours_sum = astream_quest_pages(summed, layer, q[t], t, block, n_blocks)
                # float32: the evaluation code multiplies a .float() query by keys of their own
                # dtype, which only runs when they are float32.
                ref = quest_reference_pages(module, q[t].float(), k[:t + 1].float(), t, layer, budget,
                                            policy.page_size)
                kern = quest_kernel_rule(q[t], k, t, budget, policy.page_size)
                mha = astream_rule_per_query_head(q[t], k, t, budget, policy.page_size,
                                                  policy.sink_pages, policy.recent_pages)
                bare = astream_rule_per_query_head(q[t], k, t, budget, policy.page_size, 0, 0)
                for h in range(n_heads):
                    mine = ours[h // group]
                    for name, value in (
                            ("astream_vs_eval", jaccard(mine, ref[h])),
                            ("astream_recall_of_eval", len(mine & ref[h]) / max(1, len(ref[h]))),
                            ("astream_vs_kernel", jaccard(mine, kern[h])),
                            ("astream_gqa_sum_vs_eval", jaccard(ours_sum[h // group], ref[h])),
                            ("astream_per_query_head_vs_eval", jaccard(mha[h], ref[h])),
                            ("astream_rule_no_forced_vs_eval", jaccard(bare[h], ref[h])),
                            ("eval_vs_kernel", jaccard(ref[h], kern[h]))):
                        rows[name].setdefault(layer, []).append(value)
                    pages_read["eval"].append(len(ref[h]))
                    pages_read["kernel"].append(len(kern[h]))
                pages_read["astream"].extend(len(s) for s in ours)
        out[f"budget_{budget}"] = {
            "pages_read_mean": {key: round(statistics.fmean(v), 2) for key, v in pages_read.items()},
            **{name: table(per_layer) for name, per_layer in rows.items()}}
        print(f"quest budget {budget}: " + ", ".join(
            f"{name} {out[f'budget_{budget}'][name]['overall']['mean']}" for name in rows))
    return out


# ---------------------------------------------------------------- MInference

def load_minference_reference(root: Path) -> dict:
    path = root / "minference" / "modules" / "minference_forward.py"
    recorded = []

    def vertical_slash_sparse_attention(q, k, v, v_idx, s_idx):
        recorded.append((v_idx.flatten().cpu(), s_idx.flatten().cpu()))
        return torch.zeros_like(q)

    last_q = 64                                # the module's own constant
    arange = torch.arange(last_q)
    namespace = {"torch": torch, "math": math, "recorded": recorded,
                 "LAST_Q_MASK": arange[None, None, :, None] >= arange[None, None, None, :],
                 "vertical_slash_sparse_attention": vertical_slash_sparse_attention,
                 # the other patterns of its dispatch table, never chosen here
                 "streaming_forward": None, "block_sparse_attention": None}
    return load_source_functions(path, ["sum_all_diagonal_matrix", "minference_prefill_kernel"],
                                 namespace)


def minference_reference_index(ref: dict, q: torch.Tensor, k: torch.Tensor, layer: int,
                               vertical: int, slash: int) -> list[tuple[set, set]]:
    """Per query head, the reference's (vertical columns, slash diagonals) on q [T, H, D],
    k [T, KVH, D] (its caller repeats the KV heads: repeat_kv)."""
    n_heads, group = q.shape[1], q.shape[1] // k.shape[1]
    ref["LAST_Q_MASK"] = ref["LAST_Q_MASK"].to(q.device)
    config = {"best_pattern": {layer: {str(h): ("vertical_and_slash", vertical, slash, 1)
                                       for h in range(n_heads)}}}
    out = []
    for h in range(n_heads):
        ref["recorded"].clear()
        qh = q[:, h].unsqueeze(0).unsqueeze(0)                          # [1, 1, T, D]
        kh = k[:, h // group].unsqueeze(0).unsqueeze(0)
        ref["minference_prefill_kernel"](qh, kh, torch.zeros_like(kh), h, layer, config)
        v_idx, s_idx = ref["recorded"][0]
        out.append((set(v_idx.tolist()), set(s_idx.tolist())))
    return out


def compare_minference(args, layers) -> dict:
    ref = load_minference_reference(Path(args.minference_ref))
    policy = MInferencePolicy()
    n = layers[0][0].shape[0]
    scale = layers[0][0].shape[2] ** -0.5
    out = {"last_q": policy.last_q, "sink": policy.sink, "local": policy.local}
    for label in args.minference_sizes:
        if label == "default":
            vertical, slash = policy.sizes(n)
        else:
            vertical, slash = (int(x) for x in label.split(":"))
            vertical, slash = min(max(vertical, policy.sink), n), min(max(slash, policy.local), n)
        cols, diags = {}, {}
        for layer, (q, k) in enumerate(layers):
            index = vs_ops.vertical_slash_index(q, k, last_q=policy.last_q, vertical_size=vertical,
                                                slash_size=slash, sink=policy.sink,
                                                local=policy.local, scale=scale)
            theirs = minference_reference_index(ref, q, k, layer, vertical, slash)
            for h, (v_ref, s_ref) in enumerate(theirs):
                cols.setdefault(layer, []).append(jaccard(set(index.verticals[h].tolist()), v_ref))
                diags.setdefault(layer, []).append(jaccard(set(index.slashes[h].tolist()), s_ref))
        key = f"sizes_{label.replace(':', 'x')}"
        out[key] = {"vertical_size": vertical, "slash_size": slash,
                    "vertical": table(cols), "slash": table(diags)}
        print(f"minference {label} ({vertical} columns, {slash} diagonals): vertical "
              f"{out[key]['vertical']['overall']['mean']}, slash {out[key]['slash']['overall']['mean']}")
    return out


# ---------------------------------------------------------------- XAttention

def load_xattention_reference(root: Path, use_triton: bool):
    recorded = []

    def block_sparse_attn_func(q, k, v, cu_q, cu_k, head_mask_type, streaming_info, mask,
                               *args, **kwargs):
        recorded.append(mask.cpu())
        return torch.zeros_like(q)

    sys.modules.setdefault("block_sparse_attn", types.ModuleType("block_sparse_attn"))
    sys.modules["block_sparse_attn"].block_sparse_attn_func = block_sparse_attn_func
    if not use_triton and importlib.util.find_spec("triton") is None:
        kernels = types.ModuleType("xattn.src.kernels")        # Triton-only; unused off it
        kernels.flat_group_gemm = kernels.softmax_fuse_block_sum = None
        kernels.flat_group_gemm_fuse_reshape = None
        sys.modules["xattn.src.kernels"] = kernels
    sys.path.insert(0, str(root))
    from xattn.src import Xattention
    Xattention.block_sparse_attn_func = block_sparse_attn_func
    return Xattention, recorded


def xattention_reference_effective(scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """The reference's rule, restated as its code behaves on a prompt without a prefix
    (xattn/src/utils.py `find_blocks_chunked`, called with current_index 0): scores
    [H, n_qb, n_kb] of a square causal chunk -> mask. Row r forces only its diagonal block
    (the `mask[..., 0] = 1` of the first key block is overwritten by the eye written over
    columns 0..chunk_num); the others go in descending order and the j-th (0-based) is kept
    when j == 0 or F + o_0 + ... + o_(j-2) < threshold * total, F the diagonal's score (the
    cumulative sums drop two entries, written for two forced blocks, so with one they lag
    by one: one block past the threshold is kept). The first key block is kept all the
    same, outside that sum: every entry not kept is written as index 0 before the scatter."""
    heads, n_qb, n_kb = scores.shape
    s = scores.double()
    rows = torch.arange(n_qb).view(-1, 1)
    cols = torch.arange(n_kb).view(1, -1)
    diag, others = cols == rows, cols < rows
    total = torch.where(cols <= rows, s, 0).sum(-1, keepdim=True)
    forced = torch.where(diag, s, 0).sum(-1, keepdim=True)
    ranked = torch.where(others, s, float("-inf"))
    vals, order = ranked.sort(-1, descending=True)
    vals = torch.where(vals.isfinite(), vals, 0)
    # before[j] = F + o_0 + ... + o_(j-2): the exclusive sum one entry late; j = 0 always.
    excl = vals.cumsum(-1) - vals
    before = torch.cat([torch.full_like(vals[..., :1], float("-inf")), forced + excl[..., :-1]], -1)
    keep = (before < threshold * total) & torch.gather(others.expand(heads, -1, -1), -1, order)
    mask = torch.zeros(heads, n_qb, n_kb, dtype=torch.bool).scatter(-1, order, keep)
    return mask | diag | (cols == 0)


def compare_xattention(args, layers) -> dict:
    module, recorded = load_xattention_reference(Path(args.xattention_ref), args.xattn_triton)
    policy = XAttentionPolicy()
    n = layers[0][0].shape[0]
    n_qb = -(-n // policy.block_size)
    scale = layers[0][0].shape[2] ** -0.5
    per_layer, explained, density = {}, {}, {"astream": [], "reference": []}
    for layer, (q, k) in enumerate(layers):
        scores = xattn_ops.antidiagonal_scores(q, k, block=policy.block_size, stride=policy.stride,
                                               scale=scale)
        ours = xattn_ops.select_blocks_ref(scores, threshold=policy.threshold, n_q=n, n_k=n,
                                           block=policy.block_size).cpu()
        group = q.shape[1] // k.shape[1]
        qh = q.permute(1, 0, 2).unsqueeze(0)
        kh = k.repeat_interleave(group, dim=1).permute(1, 0, 2).unsqueeze(0)
        recorded.clear()
        with cuda_to_is_noop():
            module.Xattention_prefill(qh, kh, kh, policy.stride, norm=1, threshold=policy.threshold,
                                      block_size=policy.block_size, use_triton=args.xattn_triton)
        theirs = recorded[0][0, :, :n_qb, :n_qb]
        effective = xattention_reference_effective(scores.cpu(), policy.threshold)
        for h in range(q.shape[1]):
            a = set(map(tuple, ours[h].nonzero().tolist()))
            b = set(map(tuple, theirs[h].nonzero().tolist()))
            per_layer.setdefault(layer, []).append(jaccard(a, b))
            c = set(map(tuple, effective[h].nonzero().tolist()))
            explained.setdefault(layer, []).append(jaccard(c, b))
        visible = xattn_ops.visible_block_count(n, n, policy.block_size) * q.shape[1]
        density["astream"].append(float(ours.sum()) / visible)
        density["reference"].append(float(theirs.sum()) / visible)
    out = {"threshold": policy.threshold, "stride": policy.stride, "block_size": policy.block_size,
           "reference_path": "triton" if args.xattn_triton else "torch",
           "density_mean": {key: round(statistics.fmean(v), 4) for key, v in density.items()},
           **table(per_layer),
           "astream_scores_with_reference_effective_rule_vs_reference": table(explained)}
    print(f"xattention: {out['overall']}, density {out['density_mean']}, explained "
          f"{out['astream_scores_with_reference_effective_rule_vs_reference']['overall']}")
    return out


# ---------------------------------------------------------------- FlexPrefill

FLEXPREFILL_FUNCTIONS = ["torch_bhn_sumpool", "score_cover_topk", "score_cover_idx",
                         "sum_all_diagonal_matrix", "transform_veritcal_slash_idx",
                         "square_root_js_divergence", "get_active_blocks", "flex_prefill_attention"]


def bnhd_avg_pool(x: torch.Tensor, kernel_size: int, pool_type: str = "avg") -> torch.Tensor:
    """Torch stand-in for the reference's `triton_bnhd_pool(x, kernel_size)` (average): x [B, N,
    H, D] -> [B, ceil(N / kernel_size), H, D], each block's mean over the rows it has (the
    kernel divides by `cur_block_size_n`)."""
    assert pool_type == "avg"
    b, n, h, d = x.shape
    m = -(-n // kernel_size)
    sums = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, m * kernel_size - n)).view(b, m, kernel_size, h, d).sum(2)
    counts = torch.full((m,), float(kernel_size), dtype=x.dtype, device=x.device)
    counts[-1] = n - (m - 1) * kernel_size
    return sums / counts.view(1, m, 1, 1)


def rearrange_heads(x: torch.Tensor, pattern: str) -> torch.Tensor:
    """einops.rearrange for the one pattern the reference's selection uses, where einops is
    not installed."""
    assert pattern.replace(" ", "") == "bhgij->b(hg)ij", pattern
    return x.flatten(1, 2)


def load_flexprefill_reference(root: Path) -> dict:
    """The reference's selection (`flex_prefill_attention` and `get_active_blocks` of
    flex_prefill/ops/flex_prefill_attention.py with their helpers, their own text) with
    CPU-side globals: its average-pool kernel is `bnhd_avg_pool`, its block-sparse kernel a
    recorder of the block indices it is given, its dense path (short prompts) a recorder of
    None; the Jensen-Shannon distances and the intermediates named below are recorded as
    they pass."""
    path = root / "flex_prefill" / "ops" / "flex_prefill_attention.py"
    blocks, distances = [], []

    def block_wise_attention(q, k, v, block_idx, block_size, *args, **kwargs):
        blocks.append([[index.flatten().cpu() for index in per_head] for per_head in block_idx])
        return torch.zeros_like(q)

    def dense_attention(q, *args, **kwargs):
        blocks.append(None)
        return torch.zeros_like(q)

    try:
        from einops import rearrange
    except ImportError:
        rearrange = rearrange_heads
    from typing import List, Optional, Tuple, Union
    namespace = {"torch": torch, "math": math, "rearrange": rearrange, "causal_mask": None,
                 "List": List, "Optional": Optional, "Tuple": Tuple, "Union": Union,
                 "triton_bnhd_pool": bnhd_avg_pool, "triton_block_wise_attention": block_wise_attention,
                 "flash_attn_func": dense_attention, "triton_flash_attention": dense_attention,
                 "blocks": blocks, "distances": distances}
    load_source_functions(path, FLEXPREFILL_FUNCTIONS, namespace)
    js = namespace["square_root_js_divergence"]

    def recorded_js(p, q):
        out = js(p, q)
        distances.append(out.cpu())
        return out

    namespace["square_root_js_divergence"] = recorded_js
    # get_active_blocks's own intermediates, as they pass: the per-head column / diagonal
    # counts (score_cover_topk, vertical then slash), the block-summed vertical and slash
    # (torch_bhn_sumpool, in that order) and each query-aware head's block scores.
    namespace["recorded"] = recorded = {"counts": [], "pooled_lines": [], "qa_scores": []}
    for name, key in (("score_cover_topk", "counts"), ("torch_bhn_sumpool", "pooled_lines"),
                      ("score_cover_idx", "qa_scores")):
        namespace[name] = _recording(namespace[name], recorded[key], keep_input=key == "qa_scores")
    return namespace


def _recording(function, into: list, keep_input: bool):
    def wrapper(x, *args, **kwargs):
        out = function(x, *args, **kwargs)
        into.append((x if keep_input else out).detach().cpu().clone())
        return out
    return wrapper


def flexprefill_reference_blocks(ref: dict, q: torch.Tensor, k: torch.Tensor, *, gamma: float,
                                 tau: float, min_budget: int, max_budget: int | None,
                                 block: int) -> dict:
    """The reference on q [T, H, D], k [T, KVH, D], as its Qwen2/Llama forwards call it (GQA
    not interleaved, the default softmax scale): per query head its (query block, key block)
    pairs and whether it took the query-aware pattern (None on its dense path), with the
    intermediates get_active_blocks computed (see load_flexprefill_reference)."""
    for part in (ref["blocks"], ref["distances"], *ref["recorded"].values()):
        part.clear()
    ref["causal_mask"] = None                  # its module caches one for the first block size
    n, n_heads = q.shape[0], q.shape[1]
    ref["flex_prefill_attention"](q.unsqueeze(0), k.unsqueeze(0), torch.zeros_like(k).unsqueeze(0),
                                  gamma, tau, min_budget=min_budget, max_budget=max_budget,
                                  block_size=block)
    n_b = -(-n // block)
    if ref["blocks"][0] is None:                                    # its dense path
        return {"pairs": [{(i, j) for i in range(n_b) for j in range(i + 1)}] * n_heads,
                "aware": None}
    recorded = ref["recorded"]
    aware = (ref["distances"][0][0] < tau).tolist()
    qa_heads = [h for h in range(n_heads) if aware[h]]
    return {"pairs": [set(divmod(int(x), n_b) for x in index.tolist()) for index in ref["blocks"][0][0]],
            "aware": aware, "js": ref["distances"][0][0],
            "token_counts": (recorded["counts"][0][0], recorded["counts"][1][0]),
            # its slash is indexed from the farthest diagonal block: reversed, index = distance
            "vertical": recorded["pooled_lines"][0][0], "slash": recorded["pooled_lines"][1][0].flip(-1),
            "qa_scores": {h: x.view(n_b, n_b) for h, x in zip(qa_heads, recorded["qa_scores"])}}


def flexprefill_reference_rule(vertical: torch.Tensor, slash: torch.Tensor, qa_scores: torch.Tensor,
                               aware: list[bool], token_counts: tuple[torch.Tensor, torch.Tensor],
                               *, gamma: float, min_blocks: int, max_blocks: int | None,
                               n_b: int) -> list[set]:
    """The reference's selection rule (get_active_blocks), restated on given scores of a
    prompt without a prefix: vertical and slash [H, n_b] block sums (slash indexed by
    diagonal distance), qa_scores [H, n_b, n_b] query-aware block scores, the per-head
    pattern, and the per-head counts of single columns and diagonals that reach gamma
    (score_cover_topk). A head keeps count // 128 + 1 column blocks and as many diagonal
    blocks (clamped to [min_blocks, max_blocks]; min_blocks of each on a query-aware head),
    the top ones by block sum with column block 0 and diagonal 0 first; query block i reads
    column blocks j <= i and key block i - d of each kept diagonal d. A query-aware head adds
    the (query block, key block) pairs whose scores, in descending order over the whole head,
    sum to at most gamma * n_b including their own (the pair crossing it is not kept)."""
    high = n_b if max_blocks is None else min(max_blocks, n_b)
    out = []
    for h in range(vertical.shape[0]):
        counts = []
        for raw in token_counts:
            count = min_blocks if aware[h] else min(max(int(raw[h]) // 128 + 1, min_blocks), high)
            counts.append(min(count, n_b))
        columns = _top_with_first(vertical[h], counts[0])
        diagonals = _top_with_first(slash[h], counts[1])
        pairs = {(i, j) for i in range(n_b) for j in range(i + 1)
                 if j in columns or i - j in diagonals}
        if aware[h]:
            values, order = qa_scores[h].flatten().sort(descending=True)
            kept = order[values.cumsum(0) <= gamma * n_b].tolist()
            pairs |= {divmod(x, n_b) for x in kept} | {(0, 0)}
        out.append(pairs)
    return out


def _top_with_first(scores: torch.Tensor, count: int) -> set[int]:
    """Index 0 and the count - 1 highest of the others (none for a count of 0)."""
    if count <= 0:
        return set()
    others = scores[1:].topk(count - 1).indices + 1
    return {0, *others.tolist()}


def astream_flexprefill_blocks(policy, q: torch.Tensor, k: torch.Tensor, scale: float,
                               chunk: int = 0) -> dict:
    """astream's selection as FlexPrefillRuntime._mask makes it (the dense tail, read whole
    besides, is not part of it), over the whole prompt or, with `chunk`, per prefill chunk of
    that many queries over its prefix and itself, as chunked prefill runs it: per head the
    (query block, key block) pairs, and from the last chunk whether it took the query-aware
    pattern and the estimate."""
    block, n = policy.block_size, q.shape[0]
    assert chunk % block == 0, "a chunk is whole blocks"
    chunk = chunk or n
    pairs = [set() for _ in range(q.shape[1])]
    for c0 in range(0, n, chunk):
        c1 = min(n, c0 + chunk)
        est, qa_scores = policy.estimate(q[c0:c1], k[:c1], scale)
        mask, aware = policy.select(est, qa_scores, c1 - c0, c1)
        for h, rows in enumerate(mask.cpu()):
            pairs[h] |= {(i + c0 // block, j) for i, j in rows.nonzero().tolist()}
    return {"pairs": pairs, "aware": aware.cpu().tolist(),
            "js": fp_ops.js_distance(est.pooled, est.vertical).cpu(),
            "vertical": est.vertical.cpu(), "slash": est.slash.cpu(), "qa_scores": qa_scores.cpu()}


def parse_flexprefill_setting(label: str):
    """(astream's policy, the reference's settings as a policy, astream's prefill chunk) from
    'SETTING' (both sides the same) or 'OURS/THEIRS', either followed by '@CHUNK' (astream's
    selection per chunk of that many queries; none: the whole prompt at once, as the
    reference), a setting being 'default' (astream's policy) or 'GAMMA:MIN_BUDGET' (tau and
    block as astream's)."""
    def one(text: str) -> FlexPrefillPolicy:
        if text == "default":
            return FlexPrefillPolicy()
        gamma, min_budget = text.split(":")
        return FlexPrefillPolicy(gamma=float(gamma), min_budget=int(min_budget))
    label, _, chunk = label.partition("@")
    ours, _, theirs = label.partition("/")
    return one(ours), one(theirs or ours), int(chunk or 0)


def compare_flexprefill(args, layers) -> dict:
    ref = load_flexprefill_reference(Path(args.flexprefill_ref))
    n = layers[0][0].shape[0]
    scale = layers[0][0].shape[2] ** -0.5
    out = {}
    for label in args.flexprefill_settings:
        policy, their_policy, chunk = parse_flexprefill_setting(label)
        block = policy.block_size
        n_b = -(-n // block)
        per_layer, recall, explained, their_slash, same_pattern = {}, {}, {}, {}, []
        aware_counts = {"astream": [], "reference": []}
        density = {"astream": [], "reference": []}
        gaps = {"vertical": 0.0, "slash": 0.0, "js_distance": 0.0, "query_aware_scores": 0.0}
        n_heads = layers[0][0].shape[1]
        visible = xattn_ops.visible_block_count(n, n, block) * n_heads
        for layer, (q, k) in enumerate(layers):
            ours = astream_flexprefill_blocks(policy, q, k, scale, chunk)
            theirs = flexprefill_reference_blocks(
                ref, q, k, gamma=their_policy.gamma, tau=their_policy.tau,
                min_budget=their_policy.min_budget, max_budget=their_policy.max_budget, block=block)
            their_aware = theirs["aware"] or [False] * n_heads
            # The estimates and the restated rule are compared where both read the same last
            # block of one whole prompt.
            comparable = theirs["aware"] is not None and not chunk
            if comparable:
                for name, part in (("vertical", "vertical"), ("slash", "slash"), ("js_distance", "js")):
                    gaps[name] = max(gaps[name], float((ours[part] - theirs[part]).abs().max()))
                for h, scores in theirs["qa_scores"].items():
                    gaps["query_aware_scores"] = max(gaps["query_aware_scores"], float(
                        (ours["qa_scores"][h] - scores).abs().max()))
                budget = their_policy.max_budget
                # astream's scores through the reference's rule; then with the reference's
                # diagonal sums instead of astream's (they differ where n % block != 0).
                rules = [flexprefill_reference_rule(
                    ours["vertical"], slash, ours["qa_scores"], ours["aware"],
                    theirs["token_counts"], gamma=their_policy.gamma,
                    min_blocks=-(-their_policy.min_budget // block),
                    max_blocks=None if budget is None else -(-budget // block), n_b=n_b)
                    for slash in (ours["slash"], theirs["slash"])]
            for h in range(n_heads):
                mine, their = ours["pairs"][h], theirs["pairs"][h]
                per_layer.setdefault(layer, []).append(jaccard(mine, their))
                recall.setdefault(layer, []).append(len(mine & their) / len(their))
                same_pattern.append(float(ours["aware"][h] == their_aware[h]))
                if comparable:
                    explained.setdefault(layer, []).append(jaccard(rules[0][h], their))
                    their_slash.setdefault(layer, []).append(jaccard(rules[1][h], their))
            aware_counts["astream"].append(sum(ours["aware"]))
            aware_counts["reference"].append(sum(their_aware))
            density["astream"].append(sum(map(len, ours["pairs"])) / visible)
            density["reference"].append(sum(map(len, theirs["pairs"])) / visible)
        out[label] = {
            **{name: getattr(policy, name) for name in ("gamma", "tau", "min_budget", "max_budget",
                                                        "block_size", "dense_tail")},
            "astream_prefill_chunk": chunk or None,
            "reference": {name: getattr(their_policy, name)
                          for name in ("gamma", "tau", "min_budget", "max_budget")},
            "density_mean": {name: round(statistics.fmean(v), 4) for name, v in density.items()},
            "query_aware_heads_per_layer": aware_counts,
            "same_pattern_share": round(statistics.fmean(same_pattern), 4),
            "estimate_max_abs_difference": gaps if explained else None,
            **table(per_layer),
            "astream_recall_of_reference": table(recall),
            "astream_scores_with_reference_rule_vs_reference": table(explained) if explained else None,
            "astream_scores_but_reference_slash_with_reference_rule_vs_reference":
                table(their_slash) if explained else None}
        row = out[label]
        print(f"flexprefill {label}: {row['overall']}, recall of the reference's "
              f"{row['astream_recall_of_reference']['overall']}, density {row['density_mean']}, same "
              f"pattern {row['same_pattern_share']}, query-aware heads astream "
              f"{sum(aware_counts['astream'])} / reference {sum(aware_counts['reference'])} of "
              f"{n_heads * len(layers)}, estimate gaps {gaps if explained else None}, explained "
              f"{explained and row['astream_scores_with_reference_rule_vs_reference']['overall']}, with "
              f"its diagonal sums {explained and row['astream_scores_but_reference_slash_with_reference_rule_vs_reference']['overall']}")
    return out


# ---------------------------------------------------------------- main

METHODS = ("quest", "minference", "xattention", "flexprefill")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quest-ref", help="a checkout of mit-han-lab/Quest")
    parser.add_argument("--minference-ref", help="a checkout of microsoft/MInference")
    parser.add_argument("--xattention-ref", help="a checkout of mit-han-lab/x-attention")
    parser.add_argument("--flexprefill-ref", help="a checkout of bytedance/FlexPrefill")
    parser.add_argument("--model", default=None, help="a GGUF or HF folder (default: the embedded SmolLM2)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--quest-budgets", type=lambda s: [int(x) for x in s.split(",")],
                        default=[QuestPolicy().budget_tokens, 512],
                        help="token budgets (default: astream's, 2048, and 512)")
    parser.add_argument("--quest-queries", type=int, default=8,
                        help="decode query positions, spread over the prompt's second half")
    parser.add_argument("--kv-block-size", type=int, default=16,
                        help="the cache block whose newest one astream reads whole (resident: 16)")
    parser.add_argument("--minference-sizes", type=lambda s: s.split(","),
                        default=["default", "1000:6096", "125:762"],
                        help="'default' (astream's, scaled to the length) or V:S column:diagonal counts")
    parser.add_argument("--xattn-triton", action="store_true",
                        help="run the XAttention reference's Triton path (GPU only)")
    parser.add_argument("--flexprefill-settings", type=lambda s: s.split(","),
                        default=["default", "0.95:1024", "0.9:1024", "0.9:256", "default/0.95:1024",
                                 "default@512"],
                        help="'default' (astream's policy) or GAMMA:MIN_BUDGET (tau 0.1, block 128), "
                             "the same on both sides, or OURS/THEIRS; '@CHUNK' after either: "
                             "astream's selection per prefill chunk of CHUNK queries")
    parser.add_argument("--skip", default="", help="comma list of quest,minference,xattention,flexprefill")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    for name in METHODS:
        if name not in skip and not getattr(args, f"{name}_ref"):
            parser.error(f"--{name}-ref is required unless --skip names {name}")
    model = args.model or smollm2()
    with LLM(model, device=args.device, dtype=args.dtype, max_model_len=args.prompt_len + 16) as llm:
        ids = prompt_ids(llm, args.prompt_len)
        layers = capture(llm, ids)
        model_dtype = llm.core.model.decoder.dtype
    result = {"model": Path(model).name, "device": device_name(), "dtype": args.dtype,
              "prompt_tokens": len(ids), "layers": len(layers),
              "heads": layers[0][0].shape[1], "kv_heads": layers[0][1].shape[1],
              "head_dim": layers[0][0].shape[2],
              "references": {"quest": args.quest_ref, "minference": args.minference_ref,
                             "xattention": args.xattention_ref,
                             "flexprefill": args.flexprefill_ref}}
    with torch.inference_mode():
        if "quest" not in skip:
            result["quest"] = compare_quest(args, layers, model_dtype, args.device)
        if "minference" not in skip:
            result["minference"] = compare_minference(args, layers)
        if "xattention" not in skip:
            result["xattention"] = compare_xattention(args, layers)
        if "flexprefill" not in skip:
            result["flexprefill"] = compare_flexprefill(args, layers)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
