"""KV pages: runs of `page_size` tokens inside cache blocks (block_size % page_size == 0),
the unit a decode policy selects. Physical page id = block * ppb + j, ppb = block_size //
page_size: logical page p of a sequence lives in physical page block_table[p // ppb] * ppb
+ p % ppb.

What any page-selecting policy needs, whatever chose the pages: physical ids of chosen
pages (`physical_pages`), the newest, unfinished block's pages added to a selection
(`with_newest_block`), decode attention over chosen pages (`paged_decode_selected`) and
the gather of chosen pages out of a head-major pool, which may be pinned host memory
(`gather_pages`). On CUDA the last two are Triton kernels (astream.ops.triton_pages); the
torch references here are their contracts. No op reads a device value on the host, and
every output shape follows from input shapes and host ints, so all of them run inside a
captured CUDA graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

from astream.ops.attention import select_decode_backend
from astream.ops.attention_ref import MAX_SCORE_ELEMENTS, _softmax_rows, scale_heads


def pages_per_block(block_size: int, page_size: int) -> int:
    if page_size <= 0 or block_size % page_size:
        raise ValueError(f"block_size {block_size} is not a multiple of page_size {page_size}")
    return block_size // page_size


def physical_pages(indices: Tensor, block_tables: Tensor, block_size: int,
                   page_size: int) -> Tensor:
    """indices [B, KVH, P] logical pages (inside each row's table) -> [B, KVH, P] int64
    physical page ids, block_tables [B, max_blocks] int32."""
    ppb = pages_per_block(block_size, page_size)
    batch, kv_heads, width = indices.shape
    logical = indices.long()
    blocks = block_tables.long().gather(1, (logical // ppb).view(batch, -1))
    return blocks.view(batch, kv_heads, width) * ppb + logical % ppb


def with_newest_block(indices: Tensor, counts: Tensor, block_start: Tensor, block_size: int,
                      page_size: int) -> tuple[Tensor, Tensor]:
    """Add every page of each sequence's newest (unfinished) block to its selection.

    indices [B, KVH, P] int32 and counts [B, KVH]: a selection among the pages before the
    newest block, its first `counts` entries real (as Quest's `select_pages` and the window
    policy give them); block_start [B] = the first token of that block. Returns indices
    [B, KVH, P + ppb] with the block's ppb pages right after the `counts` real ones, and
    counts + ppb. (Its pages past the context are masked by the attention's context_lens.)
    """
    ppb = pages_per_block(block_size, page_size)
    batch, kv_heads, picked = indices.shape
    pos = torch.arange(picked + ppb, device=indices.device)
    real = counts.unsqueeze(-1).long()
    first = (block_start.long() // page_size).view(batch, 1, 1)
    newest = first + (pos - real).clamp(0, ppb - 1)
    padded = torch.cat([indices, indices[..., -1:].expand(batch, kv_heads, ppb)], dim=-1).long()
    merged = torch.where(pos < real, padded, newest)
    return merged.to(torch.int32), (counts + ppb).to(torch.int32)


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
                     dst_pages: Tensor | None = None, page_size: int | None = None) -> None:
    """Copy pages of a head-major pool into dense buffers (all tensors on one device).

    src [num_blocks, KVH, block_size, D]; page_src [B, KVH, P] int64 physical page ids
    (block * ppb + j); dst [B, KVH, N * page_size, D], by default N = P (page_size =
    dst.shape[2] // P). Entry (b, h, p) fills dst[b, h, p*page_size:(p+1)*page_size] from
    KV head h of that page. With counts [B, KVH], entries p >= counts are skipped (dst keeps
    its contents). With dst_pages [B, KVH, P] (distinct per row and head, < N), entry p
    fills destination page dst_pages[b, h, p] instead of p, and entries whose dst_pages is
    negative are skipped.
    """
    n_sel = page_src.shape[2]
    page_size = page_size or dst_k.shape[2] // max(n_sel, 1)
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
        dst_view = dst.unflatten(2, (dst.shape[2] // page_size, page_size))
        dst_view[b, h, dst_pages[b, h, p].long()] = src[(ids // ppb).unsqueeze(-1),
                                                        h.unsqueeze(-1), toks].to(dst.dtype)


def paged_decode_selected(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                          page_indices: Tensor, page_counts: Tensor, context_lens: Tensor, *,
                          page_size: int, scale: float,
                          kv_scales: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """`paged_decode_selected_ref`'s contract; split-KV Triton on CUDA."""
    args = (q, k_cache, v_cache, block_tables, page_indices, page_counts, context_lens)
    kwargs = dict(page_size=page_size, scale=scale, kv_scales=kv_scales)
    if select_decode_backend(q.device) == "triton":
        from astream.ops import triton_pages
        return triton_pages.paged_decode_selected_triton(*args, **kwargs)
    return paged_decode_selected_ref(*args, **kwargs)


def gather_pages(src_k: Tensor, src_v: Tensor, page_src: Tensor, dst_k: Tensor, dst_v: Tensor,
                 counts: Tensor | None = None, dst_pages: Tensor | None = None,
                 page_size: int | None = None, background: bool = False) -> None:
    """`gather_pages_ref`'s contract; on CUDA dst the Triton kernel also reads a pinned
    host src directly (zero-copy), one page per program. A `background` gather, one that
    runs beside compute on another stream, walks the pages with a few programs
    (triton_pages.BACKGROUND_PROGRAMS): a program a page fills every SM while it waits on
    PCIe, and the compute beside it then waits too (docs/BENCHMARKS.md, Quest, prefetch)."""
    if select_decode_backend(dst_k.device) == "triton":
        from astream.ops import triton_pages
        launch = {}
        if background:
            launch = dict(programs=triton_pages.BACKGROUND_PROGRAMS, num_warps=triton_pages.BACKGROUND_WARPS,
                          pages_at_once=triton_pages.BACKGROUND_PAGES_AT_ONCE)
        triton_pages.gather_pages_triton(src_k, src_v, page_src, dst_k, dst_v, counts, dst_pages,
                                         page_size, **launch)
        return
    gather_pages_ref(src_k, src_v, page_src, dst_k, dst_v, counts, dst_pages, page_size)
