"""Quest's per-layer decode kernels at other launch shapes than the engine's: the page
scores kernel by pages per program and warps, and attention over the selected pages by
split count (the engine's choice is marked "auto").

Qwen3-4B-shaped layer (8 KV heads, 4 query heads each, head dim 128, bf16), one layer's
call replayed from a CUDA graph of 20 calls, so each figure is GPU time. Every variant's
result is checked against the engine's launch. Medians of --reps replays, us per call.

    python benchmarks/quest_kernel_sweep.py [--contexts 32768,131072] [--batches 1,4]
"""

from __future__ import annotations

import argparse

import torch
import triton

from common import save  # noqa: I001
from quest_select_sweep import BLOCK, DIM, GROUP, KV_HEADS, PAGE, call, cases, time_graph
from astream.ops import triton_quest_select as tqs
from astream.ops.triton_quest import group_tile, paged_decode_selected_triton


def scores(q, kmin, kmax, tables, lens, max_pages: int, block_p: int, warps: int) -> torch.Tensor:
    out = torch.empty(q.shape[0], KV_HEADS, max_pages, dtype=torch.float32, device=q.device)
    use_dot, group_pad = group_tile(GROUP, DIM, None)
    tqs._table_scores_kernel[(q.shape[0], KV_HEADS, triton.cdiv(max_pages, block_p))](
        q, kmin, kmax, tables, lens, out, q.stride(0), q.stride(1), kmin.stride(0),
        kmin.stride(1), kmax.stride(0), kmax.stride(1), tables.stride(0), out.stride(0),
        out.stride(1), GROUP=GROUP, GROUP_PAD=group_pad, HEAD_DIM=DIM, D_PAD=DIM, BLOCK_P=block_p,
        PAGE=PAGE, PPB=BLOCK // PAGE, USE_DOT=use_dot, PRECISION="tf32", SUM_GROUP=False,
        num_warps=warps)
    return out


def sweep_scores(data, max_pages: int, reps: int) -> dict:
    base = scores(*data, max_pages, tqs.SCORE_BLOCK_P, 4)
    row = {}
    for block_p in (32, 64, 128, 256):
        for warps in (2, 4, 8):
            same = torch.equal(scores(*data, max_pages, block_p, warps), base)
            us = time_graph(lambda: scores(*data, max_pages, block_p, warps), reps)
            row[f"scores_p{block_p}_w{warps}_us"] = us if same else f"{us} (differs)"
    return row


def bounds_layouts(kmin: torch.Tensor, kmax: torch.Tensor) -> dict:
    """The same bounds [pages, KVH, D] stored three ways (kernels take any strides)."""
    pages, heads, dim = kmin.shape
    by_head = torch.stack((kmin, kmax)).permute(0, 2, 1, 3).contiguous()      # [2, KVH, P, D]
    both = torch.stack((kmin, kmax), dim=2).permute(1, 0, 2, 3).contiguous()  # [KVH, P, 2, D]
    return {"page_major": (kmin, kmax),
            "head_major": (by_head[0].transpose(0, 1), by_head[1].transpose(0, 1)),
            "head_major_lo_hi_adjacent": (both[:, :, 0].transpose(0, 1),
                                          both[:, :, 1].transpose(0, 1))}


def sweep_layouts(data, max_pages: int, reps: int, copies: int = 4) -> dict:
    """Scores kernel per bounds layout, each call on another copy (the bounds from HBM, as a
    step's layers read them), at the engine's tile."""
    q, kmin, kmax, tables, lens = data
    base = scores(*data, max_pages, tqs.SCORE_BLOCK_P, 4)
    n = int(lens.max()) // PAGE
    row = {}
    for name in bounds_layouts(kmin, kmax):
        sets = [bounds_layouts(*pair)[name] if name != "page_major" else pair for pair in
                [(kmin.clone(), kmax.clone()) for _ in range(copies)]]
        same = torch.equal(scores(q, *sets[0], tables, lens, max_pages, tqs.SCORE_BLOCK_P, 4)[..., :n],
                           base[..., :n])
        calls = iter(range(1 << 30))

        def next_copy():
            i = next(calls) % copies
            return scores(q, *sets[i], tables, lens, max_pages, tqs.SCORE_BLOCK_P, 4)
        us = time_graph(next_copy, reps)
        row[f"layout_{name}_us"] = us if same else f"{us} (differs)"
    return row


def sweep_selected(data, budget: int, max_pages: int, reps: int) -> dict:
    q, kmin, kmax, tables, lens = data
    pages, counts, _ = call(data, budget, max_pages, None)
    batch = q.shape[0]
    blocks = tables.shape[1]
    k = torch.randn(batch * blocks, BLOCK, KV_HEADS, DIM, device="cuda").bfloat16()
    v = torch.randn_like(k)
    full_lens = lens + PAGE * (BLOCK // PAGE)           # the newest block read whole
    args = (q, k, v, tables, pages, counts, full_lens)

    def attend(splits):
        return paged_decode_selected_triton(*args, page_size=PAGE, scale=DIM ** -0.5,
                                            num_splits=splits)[0]
    base = attend(None)
    row = {"selected_auto_us": time_graph(lambda: attend(None), reps)}
    for splits in (4, 8, 16, 32, 64):
        err = (attend(splits).float() - base.float()).abs().max().item()
        us = time_graph(lambda: attend(splits), reps)
        row[f"selected_s{splits}_us"] = us if err < 2e-2 else f"{us} (err {err:.3g})"
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="32768,131072")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--layouts-only", action="store_true",
                        help="only the scores kernel per bounds layout")
    args = parser.parse_args()
    rows = []
    for context, batch, data, max_pages in cases(args):
        row = {"context": context, "batch": batch}
        if args.layouts_only:
            row.update(sweep_layouts(data, max_pages, args.reps))
        else:
            row.update(sweep_scores(data, max_pages, args.reps))
            row.update(sweep_selected(data, args.budget // PAGE, max_pages, args.reps))
        print(row, flush=True)
        rows.append(row)
    save("quest_kernel_layouts" if args.layouts_only else "quest_kernel_sweep", {"rows": rows})


if __name__ == "__main__":
    main()
