"""Triton vertical-slash prefill attention (CUDA; also runs under TRITON_INTERPRET=1).
Reference and contract: astream.ops.minference.vertical_slash_attention_ref; the layout
it walks: astream.ops.minference.vertical_slash_layout.

Grid (query block, head). A program holds its query block and, in one online softmax,
walks first its key runs (the merged diagonal bands: contiguous keys, read a tile at a
time) and then its kept columns outside them (gathered a tile at a time), each tile
masked to what the rows may see.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from astream.ops.triton_tiles import LOG2E, MIN_DOT_DIM, _dim_mask, _finish
from astream.ops.triton_xattention import _attend_tile_masked, sparse_prefill_outputs

# Launch settings (benchmarks/sparse_prefill.py --sections tune sweeps them on a GPU).
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 1


@triton.jit
def _attend_keys(q, keys, visible, k_ptr, v_ptr, kvh, stride_kt, stride_kh, stride_vt, stride_vh,
                 m_i, l_i, acc, scale_log2, dims, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                 USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
    key_ok = tl.max(visible.to(tl.int32), axis=0) > 0
    k = tl.load(k_ptr + keys[:, None] * stride_kt + kvh * stride_kh + dims[None, :],
                mask=_dim_mask(key_ok, dims, HEAD_DIM, D_PAD), other=0.0)
    v = tl.load(v_ptr + keys[:, None] * stride_vt + kvh * stride_vh + dims[None, :],
                mask=_dim_mask(key_ok, dims, HEAD_DIM, D_PAD), other=0.0)
    return _attend_tile_masked(q, k, v, visible, m_i, l_i, acc, scale_log2, USE_DOT, PRECISION)


# Lengths, and the layout strides that follow them, vary by prompt: compile once.
@triton.jit(do_not_specialize=["n_q", "n_k", "stride_rh", "stride_rq", "stride_ch", "stride_cq",
                               "stride_nh"])
def _vertical_slash_kernel(
    q_ptr, k_ptr, v_ptr, run_start_ptr, run_end_ptr, run_count_ptr, col_ptr, col_count_ptr,
    out_ptr, lse_ptr, scale_log2, n_q, n_k,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_rh, stride_rq, stride_ch, stride_cq, stride_nh, stride_ot, stride_oh, stride_lt, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    qb = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    rows = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_q
    limit = rows + (n_k - n_q)                     # the last key each row may see
    dims = tl.arange(0, D_PAD)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + dims[None, :],
                mask=_dim_mask(row_ok, dims, HEAD_DIM, D_PAD), other=0.0).to(k_ptr.dtype.element_ty)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    lane = tl.arange(0, BLOCK_N)
    runs = h * stride_rh + qb * stride_rq
    for r in range(tl.load(run_count_ptr + h * stride_nh + qb)):
        start = tl.load(run_start_ptr + runs + r)
        end = tl.load(run_end_ptr + runs + r)
        for tile in range(start, end, BLOCK_N):
            keys = tile + lane
            visible = (keys[None, :] < end) & (keys[None, :] <= limit[:, None]) & row_ok[:, None]
            m_i, l_i, acc = _attend_keys(q, keys, visible, k_ptr, v_ptr, kvh, stride_kt, stride_kh,
                                         stride_vt, stride_vh, m_i, l_i, acc, scale_log2, dims,
                                         HEAD_DIM, D_PAD, USE_DOT, PRECISION)
    cols = col_ptr + h * stride_ch + qb * stride_cq
    n_cols = tl.load(col_count_ptr + h * stride_nh + qb)
    for tile in range(0, n_cols, BLOCK_N):
        taken = tile + lane < n_cols
        keys = tl.load(cols + tile + lane, mask=taken, other=0)
        visible = taken[None, :] & (keys[None, :] <= limit[:, None]) & row_ok[:, None]
        m_i, l_i, acc = _attend_keys(q, keys, visible, k_ptr, v_ptr, kvh, stride_kt, stride_kh,
                                     stride_vt, stride_vh, m_i, l_i, acc, scale_log2, dims,
                                     HEAD_DIM, D_PAD, USE_DOT, PRECISION)
    out, lse = _finish(m_i, l_i, acc)
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=_dim_mask(row_ok, dims, HEAD_DIM, D_PAD))
    tl.store(lse_ptr + rows * stride_lt + h * stride_lh, lse, mask=row_ok)


def vertical_slash_attention_triton(q: Tensor, k: Tensor, v: Tensor, layout: tuple[Tensor, ...], *,
                                    block: int, scale: float) -> tuple[Tensor, Tensor]:
    """See astream.ops.minference.vertical_slash_attention_ref; `layout` (run starts, run
    ends, run counts, columns, column counts) from astream.ops.minference's
    vertical_slash_layout with the same block (a power of two >= 16)."""
    out, lse, (q, k, v) = sparse_prefill_outputs(q, k, v, block)
    if q.shape[0] == 0:
        return out, lse
    n_q, n_heads, head_dim = q.shape
    n_k, kv_heads, _ = k.shape
    run_start, run_end, run_count, columns, column_count = (x.contiguous() for x in layout)
    d_pad = triton.next_power_of_2(head_dim)
    _vertical_slash_kernel[(triton.cdiv(n_q, block), n_heads)](
        q, k, v, run_start, run_end, run_count, columns, column_count, out, lse, scale * LOG2E,
        n_q, n_k, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        run_start.stride(0), run_start.stride(1), columns.stride(0), columns.stride(1),
        run_count.stride(0), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        GROUP=n_heads // kv_heads, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_M=block, BLOCK_N=BLOCK_N,
        USE_DOT=d_pad >= MIN_DOT_DIM, PRECISION="ieee" if k.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return out, lse
