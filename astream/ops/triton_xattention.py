"""Triton block-sparse prefill attention over a per-head block mask (CUDA; also runs under
TRITON_INTERPRET=1). Reference and contract: astream.ops.xattention.block_sparse_attention_ref.

Grid (query block, head). A program holds its query block and walks the key blocks up to
its causal diagonal, skipping those the mask drops; online softmax in base 2 as in
triton_decode.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from astream.ops.triton_decode import (
    LOG2E, MIN_DOT_DIM, _dim_mask, _finish, _scores, _weighted_values,
)


@triton.jit
def _block_sparse_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, lse_ptr, scale_log2, n_q, n_k,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_mh, stride_mq, stride_ot, stride_oh, stride_lt, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr,
    USE_DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    qb = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    offset = n_k - n_q
    rows = qb * BLOCK + tl.arange(0, BLOCK)
    row_ok = rows < n_q
    dims = tl.arange(0, D_PAD)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + dims[None, :],
                mask=_dim_mask(row_ok, dims, HEAD_DIM, D_PAD), other=0.0)
    q = q.to(k_ptr.dtype.element_ty)
    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, D_PAD], tl.float32)
    last_row = tl.minimum(qb * BLOCK + BLOCK - 1, n_q - 1)
    last_block = (last_row + offset) // BLOCK
    mask_row = mask_ptr + h * stride_mh + qb * stride_mq
    cols = tl.arange(0, BLOCK)
    for kb in range(0, last_block + 1):
        if tl.load(mask_row + kb) != 0:
            keys = kb * BLOCK + cols
            visible = (keys[None, :] < n_k) & (keys[None, :] <= rows[:, None] + offset)
            key_ok = keys < n_k
            k = tl.load(k_ptr + keys[:, None] * stride_kt + kvh * stride_kh + dims[None, :],
                        mask=_dim_mask(key_ok, dims, HEAD_DIM, D_PAD), other=0.0)
            v = tl.load(v_ptr + keys[:, None] * stride_vt + kvh * stride_vh + dims[None, :],
                        mask=_dim_mask(key_ok, dims, HEAD_DIM, D_PAD), other=0.0)
            m_i, l_i, acc = _attend_tile_masked(q, k, v, visible, m_i, l_i, acc, scale_log2,
                                                USE_DOT, PRECISION)
    out, lse = _finish(m_i, l_i, acc)
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=_dim_mask(row_ok, dims, HEAD_DIM, D_PAD))
    tl.store(lse_ptr + rows * stride_lt + h * stride_lh, lse, mask=row_ok)


@triton.jit
def _attend_tile_masked(q, k, v, visible, m_i, l_i, acc, scale_log2,
                        USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax step over a K/V tile with a [rows, keys] mask."""
    s = tl.where(visible, _scores(q, k, USE_DOT, PRECISION) * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row with no visible key yet keeps m = -inf: shift by 0 so nothing turns into NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_new = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _weighted_values(p, v, USE_DOT, PRECISION)
    return m_new, l_new, acc


def block_sparse_attention_triton(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, *, block: int,
                                  scale: float) -> tuple[Tensor, Tensor]:
    """See astream.ops.xattention.block_sparse_attention_ref; block a power of two >= 16."""
    if block & (block - 1) or block < MIN_DOT_DIM:
        raise ValueError(f"block {block}: need a power of two >= {MIN_DOT_DIM}")
    n_q, n_heads, head_dim = q.shape
    n_k, kv_heads, _ = k.shape
    out = torch.empty(n_q, n_heads, head_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(n_q, n_heads, dtype=torch.float32, device=q.device)
    if n_q == 0:
        return out, lse
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    mask = mask.to(torch.int8).contiguous()
    d_pad = triton.next_power_of_2(head_dim)
    _block_sparse_kernel[(triton.cdiv(n_q, block), n_heads)](
        q, k, v, mask, out, lse, scale * LOG2E, n_q, n_k, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), mask.stride(0), mask.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), GROUP=n_heads // kv_heads,
        HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK=block, USE_DOT=d_pad >= MIN_DOT_DIM,
        PRECISION="ieee" if k.dtype == torch.float32 else "tf32",
        num_warps=8 if block >= 128 else 4,
    )
    return out, lse
