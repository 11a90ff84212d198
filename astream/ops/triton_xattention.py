"""Triton block-sparse prefill attention over a per-head block mask (CUDA; also runs under
TRITON_INTERPRET=1). Reference and contract: astream.ops.xattention.block_sparse_attention_ref.

Grid (query block, head). A program holds its query block and walks only the key blocks
the mask keeps, from a compacted ascending list (so a dropped block costs nothing, not
even a read of its mask bit); online softmax in base 2 as in triton_decode.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from astream.ops.triton_tiles import (
    LOG2E, MIN_DOT_DIM, _dim_mask, _finish, _scores, _weighted_values,
)


# Lengths, and the block-list strides that follow them, vary by prompt: compile once.
@triton.jit(do_not_specialize=["n_q", "n_k", "stride_kept_h", "stride_kept_q", "stride_count_h"])
def _block_sparse_kernel(
    q_ptr, k_ptr, v_ptr, kept_ptr, count_ptr, out_ptr, lse_ptr, scale_log2, n_q, n_k,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kept_h, stride_kept_q, stride_count_h, stride_ot, stride_oh, stride_lt, stride_lh,
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
    kept_row = kept_ptr + h * stride_kept_h + qb * stride_kept_q
    cols = tl.arange(0, BLOCK)
    for i in range(tl.load(count_ptr + h * stride_count_h + qb)):
        keys = tl.load(kept_row + i) * BLOCK + cols
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
    out, lse, (q, k, v) = sparse_prefill_outputs(q, k, v, block)
    if q.shape[0] == 0:
        return out, lse
    n_q, n_heads, head_dim = q.shape
    n_k, kv_heads, _ = k.shape
    kept, counts = kept_block_lists(mask)
    d_pad = triton.next_power_of_2(head_dim)
    _block_sparse_kernel[(triton.cdiv(n_q, block), n_heads)](
        q, k, v, kept, counts, out, lse, scale * LOG2E, n_q, n_k, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), kept.stride(0), kept.stride(1),
        counts.stride(0), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        GROUP=n_heads // kv_heads,
        HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK=block, USE_DOT=d_pad >= MIN_DOT_DIM,
        PRECISION="ieee" if k.dtype == torch.float32 else "tf32",
        num_warps=8 if block >= 128 else 4,
    )
    return out, lse


def sparse_prefill_outputs(q: Tensor, k: Tensor, v: Tensor,
                           block: int) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor]]:
    """A sparse prefill kernel's (out, lse) buffers, and q, k, v with unit-stride rows;
    refuses a block the kernels cannot tile (a power of two >= 16)."""
    if block & (block - 1) or block < MIN_DOT_DIM:
        raise ValueError(f"block {block}: need a power of two >= {MIN_DOT_DIM}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    return out, lse, tuple(x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))


def kept_block_lists(mask: Tensor) -> tuple[Tensor, Tensor]:
    """A block mask [H, n_qb, n_kb] as ascending kept key-block ids [H, n_qb, n_kb] int32
    (entries past the count are the dropped ones) and counts [H, n_qb] int32."""
    counts = mask.sum(-1, dtype=torch.int32)
    kept = torch.argsort((~mask.bool()).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return kept, counts
