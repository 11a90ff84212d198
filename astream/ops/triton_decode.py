"""Split-KV paged decode attention in Triton (CUDA; also runs under TRITON_INTERPRET=1).

Grid (batch, kv_head, split). One program owns every query head of one KV head
group, so each K/V tile is read from memory once for the whole group, and walks
one slice of that sequence's context. Splitting the context gives the GPU enough
programs when the batch is small; the slices are cut from each sequence's own
context_len on the device, so the launch shape depends only on (B, H, D,
num_splits) and is CUDA-graph capturable. Splits past the context write
out = 0, lse = -inf, and a second kernel merges the partials.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from astream.ops.triton_tiles import (
    LOG2E, MIN_DOT_DIM, NUM_STAGES, NUM_WARPS, _attend_tile, _dim_mask, _finish, _head_scales,
    _load_kv, _query_tile, _split_range, _store_split, _to_compute, _token_slots,
)

MIN_TOKENS_PER_SPLIT = 128  # below this a split's fixed cost outweighs the extra parallelism
MAX_SPLITS = 64
PROGRAMS_PER_SM = 4  # H100 sweep: ~4 resident programs per SM keep enough loads in flight
MAX_BLOCK_N = 128
BIG_SMEM_PER_SM = 160 * 1024  # A100 / H100 / B200 class; consumer parts have ~100 KB
DEFAULT_SM_COUNT = 132  # used off-CUDA (interpreter), where there is no device to ask


# Triton compiles a variant per property of an int argument (== 1, divisible by 16): the
# arguments that change from step to step (the tables' width, the split count and the
# partial lse's strides) would make an eager step compile anew mid-serving.
@triton.jit(do_not_specialize=["stride_tb", "stride_lb", "stride_lh", "num_splits"])
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, lse_ptr, k_scale_ptr, v_scale_ptr, scale_log2,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_tb, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_ls, num_splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr, PRECISION: tl.constexpr, HAS_SCALES: tl.constexpr,
    KV_CAST: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    lo, hi = _split_range(lens_ptr, b, split, num_splits, BLOCK_N)
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, D_PAD)
    heads = kvh * GROUP + rows
    row_mask = _dim_mask(rows < GROUP, dims, HEAD_DIM, D_PAD)
    q = _query_tile(q_ptr, b, heads, dims, row_mask, stride_qb, stride_qh,
                    k_ptr.dtype.element_ty, KV_CAST)
    # Scaled K: scores = (q . k_stored) * k_scale, so the scale joins the softmax scale;
    # scaled V: the output is v_scale times the average of the stored values.
    k_scale, v_scale = _head_scales(k_scale_ptr, v_scale_ptr, kvh, HAS_SCALES)
    scale_log2 = scale_log2 * k_scale
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    tables_row = tables_ptr + b * stride_tb
    for start in range(lo, hi, BLOCK_N):
        toks = start + tl.arange(0, BLOCK_N)
        tok_ok = toks < hi
        tok_mask = _dim_mask(tok_ok, dims, HEAD_DIM, D_PAD)
        blk, slot = _token_slots(tables_row, toks, tok_ok, PAGE)
        k, v = _load_kv(k_ptr, v_ptr, blk, slot, kvh, dims, tok_mask, stride_kb, stride_kt,
                        stride_kh, stride_vb, stride_vt, stride_vh)
        k, v = _to_compute(k, v, q, KV_CAST)
        m_i, l_i, acc = _attend_tile(q, k, v, tok_ok, m_i, l_i, acc, scale_log2,
                                     USE_DOT, PRECISION)
    out, lse = _finish(m_i, l_i, acc)
    _store_split(out_ptr, lse_ptr, out * v_scale, lse, b, split, heads, rows, dims, row_mask,
                 stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_ls, GROUP)


@triton.jit(do_not_specialize=["stride_rb", "stride_rh", "num_splits"])
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr,
    stride_pb, stride_ph, stride_ps, stride_rb, stride_rh,
    stride_ob, stride_oh, stride_lb, stride_lh, num_splits,
    SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, D_PAD)
    split_ok = splits < num_splits
    lse = tl.load(part_lse_ptr + b * stride_rb + h * stride_rh + splits,
                  mask=split_ok, other=float("-inf"))
    peak = tl.max(lse, axis=0)
    peak = tl.where(peak == float("-inf"), 0.0, peak)  # all splits empty: weights stay 0
    weights = tl.exp(lse - peak)
    total = tl.sum(weights, axis=0)
    mask = _dim_mask(split_ok, dims, HEAD_DIM, D_PAD)
    parts = tl.load(part_out_ptr + b * stride_pb + h * stride_ph + splits[:, None] * stride_ps
                    + dims[None, :], mask=mask, other=0.0)
    nonempty = total > 0.0
    out = tl.sum(parts * weights[:, None], axis=0) / tl.where(nonempty, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)
    merged_lse = tl.where(nonempty, peak + tl.log(tl.where(nonempty, total, 1.0)), float("-inf"))
    tl.store(lse_ptr + b * stride_lb + h * stride_lh, merged_lse)


def choose_num_splits(batch: int, kv_heads: int, max_context_len: int,
                      device: torch.device) -> int:
    """Splits per (sequence, kv head): enough programs to fill the GPU, none too short.

    Depends only on host ints (and the device), so it is fixed for a captured graph.
    """
    sm_count = _sm_count(device.index) if device.type == "cuda" else DEFAULT_SM_COUNT
    by_length = -(-max(max_context_len, 1) // MIN_TOKENS_PER_SPLIT)
    by_occupancy = -(-PROGRAMS_PER_SM * sm_count // max(1, batch * kv_heads))
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


# Asked once per device: an eager offload step launches the decode kernels twice a layer,
# and each property lookup resolves the device in Python again.
@functools.cache
def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _smem_per_sm(index: int | None) -> int:
    return getattr(torch.cuda.get_device_properties(index), "shared_memory_per_multiprocessor", 0)


def _block_n(d_pad: int, elem_size: int, device: torch.device) -> int:
    """Tokens per K/V tile: as many as the pipeline's shared memory allows, up to 128.

    Two stages of K and V tiles must fit: 16 KB tiles (64 KB in all) fit every sm80+
    part; 32 KB tiles only the big-smem data-center ones, where they ran 2-10% faster.
    """
    tile_bytes = 16 * 1024
    if device.type == "cuda" and _smem_per_sm(device.index) >= BIG_SMEM_PER_SM:
        tile_bytes = 32 * 1024
    block_n = MAX_BLOCK_N
    while block_n > MIN_DOT_DIM and block_n * d_pad * elem_size > tile_bytes:
        block_n //= 2
    return block_n


def scale_args(q: Tensor, k_cache: Tensor, kv_scales) -> dict:
    """Kernel arguments for a cache's dtype and scales: fp8 tiles are cast to the query's
    dtype; other caches read the query in their own dtype, as before."""
    kv_cast = k_cache.element_size() == 1
    if kv_scales is None:
        return dict(k_scale=k_cache, v_scale=k_cache, HAS_SCALES=False, KV_CAST=kv_cast)
    return dict(k_scale=kv_scales[0], v_scale=kv_scales[1], HAS_SCALES=True, KV_CAST=kv_cast)


def dot_precision(q: Tensor, k_cache: Tensor) -> str:
    """fp32 operands: exact products (the default tf32 would cost ~1e-3 relative error)."""
    operand = q.dtype if k_cache.element_size() == 1 else k_cache.dtype
    return "ieee" if operand == torch.float32 else "tf32"


def _check_inputs(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"{q.shape[1]} query heads not a multiple of {k_cache.shape[2]} kv heads")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache need a contiguous head_dim (stride(-1) == 1)")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache must share a dtype")


def _launch_split(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                  context_lens: Tensor, out: Tensor, lse: Tensor, scale: float,
                  num_splits: int, use_dot: bool | None, kv_scales=None) -> None:
    """out [B, H, S, D] / lse [B, H, S]; with S == 1 these may be views of the final tensors."""
    batch, n_heads, head_dim = q.shape
    kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    group = n_heads // kv_heads
    d_pad = triton.next_power_of_2(head_dim)
    if use_dot is None:
        # Even one query row per group is padded to 16 MMA rows: on H100 that ran ~2x faster
        # than the broadcast-multiply-reduce fallback, which only serves head_dim < 16.
        use_dot = d_pad >= MIN_DOT_DIM
    group_pad = triton.next_power_of_2(group)
    if use_dot:
        group_pad = max(group_pad, MIN_DOT_DIM)
    scaling = scale_args(q, k_cache, kv_scales)
    precision = dot_precision(q, k_cache)
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, lse, scaling.pop("k_scale"),
        scaling.pop("v_scale"), scale * LOG2E,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2), num_splits,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, D_PAD=d_pad, PAGE=page,
        BLOCK_N=_block_n(d_pad, k_cache.element_size(), q.device), USE_DOT=use_dot,
        PRECISION=precision, num_warps=NUM_WARPS, num_stages=NUM_STAGES, **scaling,
    )


def _launch_merge(part_out: Tensor, part_lse: Tensor, out: Tensor, lse: Tensor) -> None:
    """part_out [B, H, S, D] fp32, part_lse [B, H, S] contiguous -> out [B, H, D], lse [B, H]."""
    batch, n_heads, num_splits, head_dim = part_out.shape
    _merge_splits_kernel[(batch, n_heads)](
        part_out, part_lse, out, lse,
        *part_out.stride()[:3], *part_lse.stride()[:2],
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), num_splits,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim), num_warps=NUM_WARPS,
    )


def paged_decode_triton(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    *,
    scale: float,
    max_context_len: int,
    num_splits: int | None = None,
    use_dot: bool | None = None,
    kv_scales: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Paged decode; same contract as `astream.ops.backends.AttentionBackends.paged_decode`.

    max_context_len only picks num_splits (any context_lens stay correct);
    num_splits / use_dot override the heuristics (benchmarks, tests).
    """
    _check_inputs(q, k_cache, v_cache)
    batch, n_heads, head_dim = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(batch, n_heads, dtype=torch.float32, device=q.device)
    if batch == 0:
        return out, lse
    splits = num_splits or choose_num_splits(batch, k_cache.shape[2], max_context_len, q.device)
    if splits == 1:
        # Single split: the kernel writes the final tensors directly.
        _launch_split(q, k_cache, v_cache, block_tables, context_lens,
                      out.unsqueeze(2), lse.unsqueeze(2), scale, 1, use_dot, kv_scales)
        return out, lse
    part_out = torch.empty(batch, n_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, n_heads, splits, dtype=torch.float32, device=q.device)
    _launch_split(q, k_cache, v_cache, block_tables, context_lens, part_out, part_lse,
                  scale, splits, use_dot, kv_scales)
    _launch_merge(part_out, part_lse, out, lse)
    return out, lse
