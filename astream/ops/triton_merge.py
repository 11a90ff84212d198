"""Triton kernel merging a partial attention result into some rows of another, in place
(CUDA; also runs under TRITON_INTERPRET=1). Reference and contract:
astream.ops.attention.merge_into_rows.

Grid (row, head): one launch instead of the dozen elementwise ops, gathers and scatters
of the torch composition; the offload path merges once per ring slot and sparse layer.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from astream.ops.triton_tiles import NUM_WARPS


@triton.jit
def _merge_rows_kernel(
    out_ptr, lse_ptr, rows_ptr, part_ptr, part_lse_ptr,
    stride_ot, stride_oh, stride_lt, stride_lh, stride_pt, stride_ph, stride_qt, stride_qh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(rows_ptr + i).to(tl.int64)
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < HEAD_DIM
    lse_a = tl.load(lse_ptr + row * stride_lt + h * stride_lh)
    lse_b = tl.load(part_lse_ptr + i * stride_qt + h * stride_qh)
    peak = tl.maximum(lse_a, lse_b)
    # Both sides empty: shift by 0 so the weights stay exp(-inf) = 0, never NaN.
    shift = tl.where(peak == float("-inf"), 0.0, peak)
    w_a = tl.exp(lse_a - shift)
    w_b = tl.exp(lse_b - shift)
    total = w_a + w_b
    denom = tl.where(total > 0.0, total, 1.0)
    a = tl.load(out_ptr + row * stride_ot + h * stride_oh + dims, mask=dim_ok, other=0.0)
    b = tl.load(part_ptr + i * stride_pt + h * stride_ph + dims, mask=dim_ok, other=0.0)
    merged = (a.to(tl.float32) * w_a + b.to(tl.float32) * w_b) / denom
    tl.store(out_ptr + row * stride_ot + h * stride_oh + dims,
             merged.to(out_ptr.dtype.element_ty), mask=dim_ok)
    tl.store(lse_ptr + row * stride_lt + h * stride_lh, shift + tl.log(total))


def merge_into_rows_triton(out: Tensor, lse: Tensor, rows: Tensor, part_out: Tensor,
                           part_lse: Tensor) -> tuple[Tensor, Tensor]:
    """out [T, H, D], lse [T, H] f32 updated in place at rows [R] with part [R, H, D] / [R, H]."""
    n_rows, n_heads, head_dim = part_out.shape
    if n_rows == 0:
        return out, lse
    rows = rows.contiguous()
    _merge_rows_kernel[(n_rows, n_heads)](
        out, lse, rows, part_out, part_lse, out.stride(0), out.stride(1), lse.stride(0),
        lse.stride(1), part_out.stride(0), part_out.stride(1), part_lse.stride(0),
        part_lse.stride(1), HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim),
        num_warps=NUM_WARPS if head_dim >= 128 else 1,
    )
    return out, lse
