"""Quest (Tang et al., ICML 2024) device-side ops for decode: page key bounds, attention
over selected pages and the page gather that feeds it from a host pool. Which pages a
query selects: astream.ops.quest_select.

Pages are runs of `page_size` tokens inside cache blocks (block_size % page_size == 0);
physical page id = block * (block_size // page_size) + j. Logical page p of a sequence
lives in physical page block_table[p // ppb] * ppb + p % ppb, ppb = block_size // page_size.

Bounds describe the keys as the cache stores them, in its element type: min and max
only select stored values, so they are exact in it (float32 would double their memory
for nothing). An fp8 cache stores value / scale with one positive scale per (layer, KV
head): scores from its bounds are those of the dequantized keys divided by the head's
scale, so they rank a head's pages alike, from half the bytes of bf16 bounds.

No op here reads a device value on the host, and every output shape follows from input
shapes and host ints, so all of them can run inside a captured CUDA graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

from astream.ops.attention import select_decode_backend
from astream.ops.attention_ref import MAX_SCORE_ELEMENTS, _softmax_rows, scale_heads
from astream.ops.kv_write import as_bytes

DEFAULT_PAGE_SIZE = 16
GQA_REDUCTIONS = ("max", "sum")


def pages_per_block(block_size: int, page_size: int) -> int:
    if page_size <= 0 or block_size % page_size:
        raise ValueError(f"block_size {block_size} is not a multiple of page_size {page_size}")
    return block_size // page_size


def allocate_page_bounds(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, *,
                         dtype: torch.dtype, device: torch.device | str,
                         page_size: int = DEFAULT_PAGE_SIZE) -> tuple[Tensor, Tensor]:
    """Empty bounds for every page of `num_blocks` blocks (count a scratch block in too).

    Returns kmin, kmax [num_blocks * ppb, kv_heads, head_dim] in `dtype`, set to +inf / -inf
    (the identities of min / max; the largest finite values in a type without infinities,
    float8_e4m3fn), so an unwritten page bounds nothing.
    """
    shape = (num_blocks * pages_per_block(block_size, page_size), kv_heads, head_dim)
    top = _empty_bound(dtype)
    return (torch.full(shape, top, dtype=dtype, device=device),
            torch.full(shape, -top, dtype=dtype, device=device))


def _empty_bound(dtype: torch.dtype) -> float:
    """An empty page's kmin (its kmax is the negation): +inf, or the largest finite value of
    a type without infinities."""
    return torch.finfo(dtype).max if dtype == torch.float8_e4m3fn else float("inf")


def update_page_bounds(kmin: Tensor, kmax: Tensor, keys: Tensor, slots: Tensor,
                       page_size: int = DEFAULT_PAGE_SIZE) -> None:
    """Fold keys [T, KVH, D] just written at flat cache slots [T] (int64) into the bounds.

    A page whose first token (page offset 0) is among the new tokens is being (re)filled,
    so it is reset first: that makes prefill chunks, single decode tokens and pages reused
    after a free all exact. Padding rows may target one scratch slot many times. On CUDA
    one Triton kernel (a page's new tokens must be consecutive rows, as one sequence's are).
    """
    if select_quest_backend(keys.device) == "triton":
        from astream.ops import triton_quest_select
        triton_quest_select.update_page_bounds_triton(kmin, kmax, keys, slots, page_size)
        return
    if keys.shape[0] == 0:
        return
    # In float32 over the touched pages' rows, read and written as bytes: no float8 type
    # has min/max or scatter kernels on the CPU. Rows sorted by page make each page one
    # run; every row of a run writes the run's result, so duplicate writes agree.
    pages, order = torch.sort(slots.long() // page_size, stable=True)
    rows = torch.arange(pages.shape[0], device=pages.device)
    run_start = torch.ones_like(pages, dtype=torch.bool)
    run_start[1:] = pages[1:] != pages[:-1]
    first = torch.cummax(torch.where(run_start, rows, 0), 0).values
    restart = torch.zeros_like(pages).scatter_reduce_(
        0, first, (slots.long()[order] % page_size == 0).long(), "amax").bool()[first]
    index = first.view(-1, 1, 1).expand(-1, *keys.shape[1:])
    keys = keys[order].float()
    for bounds, reduce, empty in ((kmin, "amin", float("inf")), (kmax, "amax", float("-inf"))):
        held = as_bytes(bounds).index_select(0, pages).view(bounds.dtype).float()
        held = torch.where(restart.view(-1, 1, 1), empty, held)
        folded = held.scatter_reduce_(0, index, keys, reduce)[first]
        as_bytes(bounds).index_copy_(0, pages, as_bytes(folded.to(bounds.dtype)))


def bounds_of_blocks(keys_blocks: Tensor, page_size: int = DEFAULT_PAGE_SIZE,
                     num_valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Bounds of whole blocks: keys_blocks [n, block_size, KVH, D] -> kmin, kmax [n*ppb, KVH, D].

    num_valid [n] (optional) counts the written tokens of each block; the rest are ignored
    (a page with none gets allocate_page_bounds' empty bounds). Output dtype = keys' dtype.
    """
    n, block_size, kv_heads, head_dim = keys_blocks.shape
    ppb = pages_per_block(block_size, page_size)
    lo = hi = keys_blocks.float()              # float8 has no masked_fill or min on the CPU
    if num_valid is not None:
        hidden = torch.arange(block_size, device=keys_blocks.device) >= num_valid.view(-1, 1)
        hidden = hidden.view(n, block_size, 1, 1)
        lo = lo.masked_fill(hidden, float("inf"))
        hi = hi.masked_fill(hidden, float("-inf"))
    top = _empty_bound(keys_blocks.dtype)
    kmin, kmax = (reduce(side.unflatten(1, (ppb, page_size)), dim=2).clamp(-top, top)
                  .reshape(n * ppb, kv_heads, head_dim).to(keys_blocks.dtype)
                  for side, reduce in ((lo, torch.amin), (hi, torch.amax)))
    return kmin, kmax


def store_block_bounds(kmin: Tensor, kmax: Tensor, keys_blocks: Tensor, blocks: Tensor,
                       page_size: int = DEFAULT_PAGE_SIZE,
                       num_valid: Tensor | None = None) -> None:
    """Overwrite the bounds of the pages of blocks [n] (int64) with those of keys_blocks."""
    ppb = pages_per_block(keys_blocks.shape[1], page_size)
    pages = (blocks.long().view(-1, 1) * ppb + torch.arange(ppb, device=blocks.device)).view(-1)
    lo, hi = bounds_of_blocks(keys_blocks, page_size, num_valid)
    for bounds, side in ((kmin, lo), (kmax, hi)):
        as_bytes(bounds).index_copy_(0, pages, as_bytes(side.to(bounds.dtype)))


def _selected_slots(block_tables: Tensor, page_indices: Tensor, page_counts: Tensor,
                    context_lens: Tensor, page_size: int, block_size: int,
                    num_blocks: int) -> tuple[Tensor, Tensor, Tensor]:
    """(block, in-block offset, visible) [B, KVH, Pmax * page_size] of every selected token."""
    batch, kv_heads, max_sel = page_indices.shape
    device = page_indices.device
    real = torch.arange(max_sel, device=device) < page_counts.unsqueeze(-1)
    toks = page_indices.long().unsqueeze(-1) * page_size + torch.arange(page_size, device=device)
    visible = real.unsqueeze(-1) & (toks < context_lens.view(-1, 1, 1, 1))
    toks = torch.where(visible, toks, 0).view(batch, -1)
    # Table entries past a context may be garbage: clamp so the gather stays in bounds.
    blocks = block_tables.long().gather(1, toks // block_size).clamp(0, num_blocks - 1)
    shape = (batch, kv_heads, max_sel * page_size)
    return blocks.view(shape), (toks % block_size).view(shape), visible.view(shape)


def _selected_chunk(q: Tensor, k_cache: Tensor, v_cache: Tensor, blocks: Tensor, offs: Tensor,
                    visible: Tensor, scale: float,
                    kv_scales: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
    """Attention of q [b, H, D] over the gathered tokens -> out [b, H, D] f32, lse [b, H]."""
    batch, n_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    heads = torch.arange(kv_heads, device=q.device).view(1, -1, 1)
    k_scale, v_scale = kv_scales or (None, None)
    keys = scale_heads(k_cache[blocks, offs, heads].float(), k_scale)  # [b, KVH, N, D]
    values = scale_heads(v_cache[blocks, offs, heads].float(), v_scale)
    # A skipped entry's bytes may be anything, NaN included (an fp8 buffer's garbage often
    # is); its probability is 0, but 0 * NaN is not.
    values.masked_fill_(~visible.unsqueeze(-1), 0.0)
    qg = q.float().view(batch, kv_heads, n_heads // kv_heads, head_dim)
    scores = torch.matmul(qg, keys.transpose(2, 3)).mul_(scale)  # [b, KVH, G, N]
    scores.masked_fill_(~visible.unsqueeze(2), float("-inf"))
    probs, lse = _softmax_rows(scores)
    out = torch.matmul(probs, values)
    return out.reshape(batch, n_heads, head_dim), lse.reshape(batch, n_heads)


def paged_decode_selected_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                              page_indices: Tensor, page_counts: Tensor, context_lens: Tensor, *,
                              page_size: int, scale: float,
                              kv_scales: tuple[Tensor, Tensor] | None = None
                              ) -> tuple[Tensor, Tensor]:
    """Decode attention over selected pages only -> out [B, H, D] (q.dtype), lse [B, H] f32.

    q [B, H, D]; caches [num_blocks, block_size, KVH, D] (any strides); block_tables
    [B, max_blocks] int32; page_indices [B, KVH, Pmax] int32 logical pages, the first
    page_counts [B, KVH] of them distinct and real; context_lens [B] int32. Query head h
    reads the pages of KV head h // (H // KVH), tokens < context_len only (the newest page
    may be partial). Nothing visible -> out 0, lse -inf. kv_scales: as in
    paged_decode_attention_ref.
    """
    batch, n_heads, head_dim = q.shape
    num_blocks, block_size, kv_heads = k_cache.shape[:3]
    pages_per_block(block_size, page_size)
    out = torch.zeros(batch, n_heads, head_dim, dtype=q.dtype, device=q.device)
    lse = torch.full((batch, n_heads), float("-inf"), dtype=torch.float32, device=q.device)
    n_tokens = page_indices.shape[2] * page_size
    if batch == 0 or n_tokens == 0:
        return out, lse
    slots = _selected_slots(block_tables, page_indices, page_counts, context_lens,
                            page_size, block_size, num_blocks)
    step = max(1, MAX_SCORE_ELEMENTS // (n_tokens * max(n_heads, 2 * kv_heads * head_dim)))
    for b0 in range(0, batch, step):
        rows = slice(b0, min(b0 + step, batch))
        o, s = _selected_chunk(q[rows], k_cache, v_cache, *(x[rows] for x in slots), scale,
                               kv_scales)
        out[rows] = o.to(q.dtype)
        lse[rows] = s
    return out, lse


def gather_pages_ref(src_k: Tensor, src_v: Tensor, page_src: Tensor, dst_k: Tensor,
                     dst_v: Tensor, counts: Tensor | None = None,
                     dst_pages: Tensor | None = None) -> None:
    """Copy pages of a head-major pool into dense buffers (all tensors on one device).

    src [num_blocks, KVH, block_size, D]; page_src [B, KVH, P] int64 physical page ids
    (block * ppb + j); dst [B, KVH, P * page_size, D], page_size = dst.shape[2] // P.
    Entry (b, h, p) fills dst[b, h, p*page_size:(p+1)*page_size] from KV head h of that
    page. With counts [B, KVH], entries p >= counts are skipped (dst keeps its contents).
    With dst_pages [B, KVH, P] (distinct per row and head), entry p fills destination page
    dst_pages[b, h, p] instead of p, and entries whose dst_pages is negative are skipped.
    """
    n_sel = page_src.shape[2]
    page_size = dst_k.shape[2] // max(n_sel, 1)
    ppb = pages_per_block(src_k.shape[2], page_size)
    if dst_pages is None:
        dst_pages = torch.arange(n_sel, device=page_src.device).expand(page_src.shape)
    keep = dst_pages >= 0
    if counts is not None:
        keep &= torch.arange(n_sel, device=page_src.device) < counts.unsqueeze(-1)
    b, h, p = keep.nonzero(as_tuple=True)       # garbage ids past the counts are never read
    ids = page_src[b, h, p].long()
    toks = (ids % ppb).unsqueeze(-1) * page_size + torch.arange(page_size, device=ids.device)
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        dst_view = dst.unflatten(2, (n_sel, page_size))
        dst_view[b, h, dst_pages[b, h, p].long()] = src[(ids // ppb).unsqueeze(-1),
                                                        h.unsqueeze(-1), toks].to(dst.dtype)


def select_quest_backend(device: torch.device | str) -> str:
    """Backend of the Quest ops for tensors on `device`: "triton" | "reference". They are
    built on the decode kernels' Triton pieces, so the decode rule decides for both."""
    return select_decode_backend(device)


def paged_decode_selected(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                          page_indices: Tensor, page_counts: Tensor, context_lens: Tensor, *,
                          page_size: int, scale: float,
                          kv_scales: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """`paged_decode_selected_ref`'s contract; split-KV Triton on CUDA."""
    args = (q, k_cache, v_cache, block_tables, page_indices, page_counts, context_lens)
    kwargs = dict(page_size=page_size, scale=scale, kv_scales=kv_scales)
    if select_quest_backend(q.device) == "triton":
        from astream.ops import triton_quest
        return triton_quest.paged_decode_selected_triton(*args, **kwargs)
    return paged_decode_selected_ref(*args, **kwargs)


def gather_pages(src_k: Tensor, src_v: Tensor, page_src: Tensor, dst_k: Tensor, dst_v: Tensor,
                 counts: Tensor | None = None, dst_pages: Tensor | None = None) -> None:
    """`gather_pages_ref`'s contract; on CUDA dst the Triton kernel also reads a pinned
    host src directly (zero-copy), one page per program."""
    if select_quest_backend(dst_k.device) == "triton":
        from astream.ops import triton_quest
        triton_quest.gather_pages_triton(src_k, src_v, page_src, dst_k, dst_v, counts, dst_pages)
        return
    gather_pages_ref(src_k, src_v, page_src, dst_k, dst_v, counts, dst_pages)
