"""Triton kernels of the page ops (CUDA; also run under TRITON_INTERPRET=1).

- selected-pages decode: the split-KV decode of triton_decode over a (sequence, KV
  head)'s selected pages instead of its whole context. Grid (batch, kv_head, split):
  one program owns a KV head's whole query group, so each K/V tile is loaded once;
  the split count comes from host ints only, so the launch is graph-capturable.
- page gather: grid (page, kv_head, batch); copies one K and one V page per program
  from a head-major pool, which on CUDA may be pinned host memory read in place.

Torch references and the contracts live in astream.ops.pages.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from astream.ops.triton_decode import (
    _block_n, _check_inputs, _launch_merge, choose_num_splits, dot_precision, scale_args,
)
from astream.ops.triton_tiles import (
    LOG2E, MIN_DOT_DIM, NUM_STAGES, NUM_WARPS, _attend_tile, _dim_mask, _finish, _head_scales,
    _load_kv, _query_tile, _split_range, _store_split, _to_compute, _token_slots,
)


# As in triton_decode: no variant per value of the arguments that change from step to step.
@triton.jit(do_not_specialize=["stride_tb", "stride_lb", "stride_lh", "num_splits"])
def _selected_split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, pages_ptr, counts_ptr, out_ptr, lse_ptr,
    k_scale_ptr, v_scale_ptr, scale_log2, stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
    stride_vh, stride_tb, stride_pb, stride_ph, stride_cb, stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh, stride_ls, num_splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr, PRECISION: tl.constexpr, HAS_SCALES: tl.constexpr,
    KV_CAST: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # Splits are cut in selected pages: this (b, kvh)'s count plays the context length.
    lo, hi = _split_range(counts_ptr + b * stride_cb, kvh, split, num_splits, BLOCK_N // PAGE)
    ctx = tl.load(lens_ptr + b)
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, D_PAD)
    heads = kvh * GROUP + rows
    row_mask = _dim_mask(rows < GROUP, dims, HEAD_DIM, D_PAD)
    q = _query_tile(q_ptr, b, heads, dims, row_mask, stride_qb, stride_qh,
                    k_ptr.dtype.element_ty, KV_CAST)
    k_scale, v_scale = _head_scales(k_scale_ptr, v_scale_ptr, kvh, HAS_SCALES)
    scale_log2 = scale_log2 * k_scale
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    tables_row = tables_ptr + b * stride_tb
    pages_row = pages_ptr + b * stride_pb + kvh * stride_ph
    n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N // PAGE):
        sel = start + n // PAGE
        page = tl.load(pages_row + sel, mask=sel < hi, other=0).to(tl.int64)
        toks = page * PAGE + n % PAGE
        tok_ok = (sel < hi) & (toks < ctx)
        blk, slot = _token_slots(tables_row, toks, tok_ok, BLOCK)
        tok_mask = _dim_mask(tok_ok, dims, HEAD_DIM, D_PAD)
        k, v = _load_kv(k_ptr, v_ptr, blk, slot, kvh, dims, tok_mask, stride_kb, stride_kt,
                        stride_kh, stride_vb, stride_vt, stride_vh)
        k, v = _to_compute(k, v, q, KV_CAST)
        m_i, l_i, acc = _attend_tile(q, k, v, tok_ok, m_i, l_i, acc, scale_log2,
                                     USE_DOT, PRECISION)
    out, lse = _finish(m_i, l_i, acc)
    _store_split(out_ptr, lse_ptr, out * v_scale, lse, b, split, heads, rows, dims, row_mask,
                 stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_ls, GROUP)


# A gather beside compute: 32 programs of 4 warps, 8 pages a pass, on 32 SMs; the layer's
# GEMVs beside them keep the rest. A program a page reads at the same rate alone but blocks
# them. Fewer programs starve the link where pages are small (fp8 keeps 16 KB pages; at
# batch 4, 8 programs took 18.3 ms a step and 32 took 13.1, H200); 64 slow the compute.
BACKGROUND_PROGRAMS, BACKGROUND_PAGES_AT_ONCE, BACKGROUND_WARPS = 32, 8, 4


@triton.jit
def _gather_pages_kernel(
    src_k, src_v, pages_ptr, counts_ptr, dst_pages_ptr, dst_k, dst_v,
    stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_pb, stride_ph,
    stride_cb, stride_ch, stride_db, stride_dh, stride_dt, stride_eb, stride_eh, stride_et,
    n_sel, kv_heads, n_items,
    PPB: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    HAS_COUNTS: tl.constexpr, HAS_DST_PAGES: tl.constexpr, PAGES_AT_ONCE: tl.constexpr,
):
    # Item = (b * kv_heads + h) * groups + g copies entries g * PAGES_AT_ONCE ... of row
    # (b, h); a program takes every num_programs-th item.
    rows = tl.arange(0, PAGES_AT_ONCE * PAGE)
    dims = tl.arange(0, D_PAD)
    groups = tl.cdiv(n_sel, PAGES_AT_ONCE)
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        sel = (item % groups) * PAGES_AT_ONCE + rows // PAGE
        h = (item // groups) % kv_heads
        b = (item // (groups * kv_heads)).to(tl.int64)  # b * stride_db passes 2**31 on large batches
        count = sel + 1
        if HAS_COUNTS:
            count = tl.load(counts_ptr + b * stride_cb + h * stride_ch)
        count = tl.where(sel < n_sel, count, 0)
        entry = b * stride_pb + h * stride_ph + sel
        page = tl.load(pages_ptr + entry, mask=sel < n_sel, other=0).to(tl.int64)
        dst_page = sel.to(tl.int64)
        if HAS_DST_PAGES:          # same strides as the page ids; negative: nothing to copy
            dst_page = tl.load(dst_pages_ptr + entry, mask=sel < n_sel, other=-1).to(tl.int64)
            count = tl.where(dst_page >= 0, count, 0)
            dst_page = tl.maximum(dst_page, 0)
        # A skipped entry (maybe a garbage id) is masked on both sides: no bytes move for it.
        mask = _dim_mask(sel < count, dims, HEAD_DIM, D_PAD)
        src_t = ((page % PPB) * PAGE + rows % PAGE)[:, None]
        dst_t = (dst_page * PAGE + rows % PAGE)[:, None]
        blk = (page // PPB)[:, None]
        k = tl.load(src_k + blk * stride_kb + h * stride_kh + src_t * stride_kt + dims[None, :],
                    mask=mask)
        v = tl.load(src_v + blk * stride_vb + h * stride_vh + src_t * stride_vt + dims[None, :],
                    mask=mask)
        dst = b * stride_db + h * stride_dh + dst_t * stride_dt + dims[None, :]
        tl.store(dst_k + dst, k, mask=mask)
        tl.store(dst_v + b * stride_eb + h * stride_eh + dst_t * stride_et + dims[None, :], v,
                 mask=mask)


def group_tile(group: int, d_pad: int, use_dot: bool | None) -> tuple[bool, int]:
    """(use_dot, padded query-group rows), as triton_decode chooses them."""
    if use_dot is None:
        use_dot = d_pad >= MIN_DOT_DIM
    group_pad = triton.next_power_of_2(group)
    return use_dot, max(group_pad, MIN_DOT_DIM) if use_dot else group_pad


def _launch_selected(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor,
                     lens: Tensor, pages: Tensor, counts: Tensor, out: Tensor, lse: Tensor,
                     page_size: int, scale: float, use_dot: bool | None, kv_scales=None) -> None:
    """out [B, H, S, D] / lse [B, H, S]: one partial result per split S."""
    batch, n_heads, head_dim = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    d_pad = triton.next_power_of_2(head_dim)
    use_dot, group_pad = group_tile(n_heads // kv_heads, d_pad, use_dot)
    block_n = max(_block_n(d_pad, k_cache.element_size(), q.device), page_size)
    scaling = scale_args(q, k_cache, kv_scales)
    _selected_split_kernel[(batch, kv_heads, out.shape[2])](
        q, k_cache, v_cache, tables, lens, pages, counts, out, lse, scaling.pop("k_scale"),
        scaling.pop("v_scale"), scale * LOG2E,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        tables.stride(0), pages.stride(0), pages.stride(1), counts.stride(0),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        lse.stride(2), out.shape[2], GROUP=n_heads // kv_heads, GROUP_PAD=group_pad,
        HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK=block_size, PAGE=page_size, BLOCK_N=block_n,
        USE_DOT=use_dot, PRECISION=dot_precision(q, k_cache), num_warps=NUM_WARPS,
        num_stages=NUM_STAGES, **scaling,
    )


def paged_decode_selected_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor,
                                 block_tables: Tensor, page_indices: Tensor, page_counts: Tensor,
                                 context_lens: Tensor, *, page_size: int, scale: float,
                                 num_splits: int | None = None, use_dot: bool | None = None,
                                 kv_scales: tuple[Tensor, Tensor] | None = None
                                 ) -> tuple[Tensor, Tensor]:
    """See astream.ops.pages.paged_decode_selected_ref. page_size must be a power of two
    dividing block_size; num_splits / use_dot override the heuristics (tests, benchmarks)."""
    _check_inputs(q, k_cache, v_cache)
    if page_size & (page_size - 1) or k_cache.shape[1] % page_size:
        raise ValueError(f"page_size {page_size}: need a power of two dividing the block size")
    batch, n_heads, head_dim = q.shape
    q = q if q.stride(-1) == 1 else q.contiguous()
    # The kernel walks a row of page indices / counts with unit stride.
    page_indices = page_indices if page_indices.stride(-1) == 1 else page_indices.contiguous()
    page_counts = page_counts if page_counts.stride(-1) == 1 else page_counts.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(batch, n_heads, dtype=torch.float32, device=q.device)
    if batch == 0:
        return out, lse
    args = (q, k_cache, v_cache, block_tables, context_lens, page_indices, page_counts)
    splits = num_splits or choose_num_splits(batch, k_cache.shape[2],
                                             page_indices.shape[2] * page_size, q.device)
    if splits == 1:
        _launch_selected(*args, out.unsqueeze(2), lse.unsqueeze(2), page_size, scale, use_dot,
                         kv_scales)
        return out, lse
    part_out = torch.empty(batch, n_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, n_heads, splits, dtype=torch.float32, device=q.device)
    _launch_selected(*args, part_out, part_lse, page_size, scale, use_dot, kv_scales)
    _launch_merge(part_out, part_lse, out, lse)
    return out, lse


def gather_pages_triton(src_k: Tensor, src_v: Tensor, page_src: Tensor, dst_k: Tensor,
                        dst_v: Tensor, counts: Tensor | None = None,
                        dst_pages: Tensor | None = None, page_size: int | None = None,
                        programs: int | None = None, num_warps: int = NUM_WARPS,
                        pages_at_once: int = 1) -> None:
    """See astream.ops.pages.gather_pages_ref. src may be pinned host memory (mapped into
    the device's address space); every tensor needs a contiguous head_dim. One program a
    page, or at most `programs` programs that walk them all (a gather beside compute)."""
    batch, kv_heads, n_sel = page_src.shape
    if n_sel == 0 or batch == 0:
        return
    page_size = page_size or dst_k.shape[2] // n_sel
    block_size, head_dim = src_k.shape[2], src_k.shape[3]
    if page_size & (page_size - 1) or block_size % page_size:
        raise ValueError(f"page_size {page_size}: need a power of two dividing {block_size}")
    page_src = page_src.contiguous()
    has_counts, has_dst = counts is not None, dst_pages is not None
    counts = counts if has_counts else page_src  # unread placeholder
    dst_pages = dst_pages.contiguous() if has_dst else page_src
    n_items = batch * kv_heads * -(-n_sel // pages_at_once)
    _gather_pages_kernel[(min(n_items, programs or n_items),)](
        src_k, src_v, page_src, counts, dst_pages, dst_k, dst_v, *src_k.stride()[:3],
        *src_v.stride()[:3],
        page_src.stride(0), page_src.stride(1), counts.stride(0), counts.stride(1),
        *dst_k.stride()[:3], *dst_v.stride()[:3], n_sel, kv_heads, n_items,
        PPB=block_size // page_size, PAGE=page_size,
        HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim), HAS_COUNTS=has_counts,
        HAS_DST_PAGES=has_dst, PAGES_AT_ONCE=pages_at_once, num_warps=num_warps,
    )
