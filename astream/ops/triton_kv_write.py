"""Triton kernel storing K/V rows into KV storage, quantizing for 8-bit floats (CUDA; also
runs under TRITON_INTERPRET=1). Reference and contract: astream.ops.kv_write.

Grid (token,): one program moves one token's K and V for every KV head, so a layer's KV
write is one launch; the fp8 path (divide, saturate, cast) would be about ten in torch.
The head-major store (the offload engine's staging and tails) is a plain move, bytes as
they are, with the same grid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# (mantissa bits, smallest normal exponent) of the 8-bit float formats a scaled cache holds
FP8_GRIDS = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}


@triton.jit
def _round_to_grid(x, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """float32 x rounded to nearest-even on an 8-bit float's grid (MANTISSA bits, smallest
    normal exponent MIN_EXP), so the cast that follows is exact on every target: some
    conversions (older GPUs' emulation, the interpreter) do not round to nearest-even."""
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step_exp = tl.maximum(exponent, MIN_EXP) - MANTISSA
    inv_step = ((127 - step_exp) << 23).to(tl.float32, bitcast=True)   # 2 ** -step_exp
    step = ((127 + step_exp) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0                  # 1.5 * 2**23: adding it rounds |y| < 2**22 to an integer
    rounded = ((x * inv_step + magic) - magic) * step
    return tl.where(rounded == 0.0, x * 0.0, rounded)      # keeps the sign of a zero


@triton.jit
def _store_rows(src_ptr, dst_ptr, scale_ptr, t, base, stride_t, stride_h, heads, dims, mask,
                KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SCALED: tl.constexpr,
                LARGEST: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    x = tl.load(src_ptr + t * stride_t + heads * stride_h + dims, mask=mask, other=0.0)
    if SCALED:
        scale = tl.load(scale_ptr + heads, mask=heads < KV_HEADS, other=1.0)
        x = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -LARGEST), LARGEST)
        x = _round_to_grid(x, MANTISSA, MIN_EXP)
    tl.store(dst_ptr + base + heads * HEAD_DIM + dims, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, dst_k_ptr, dst_v_ptr, rows_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
    HAS_ROWS: tl.constexpr, SCALED: tl.constexpr, LARGEST: tl.constexpr,
    MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, H_PAD)[:, None]
    dims = tl.arange(0, D_PAD)[None, :]
    mask = (heads < KV_HEADS) & (dims < HEAD_DIM)
    if HAS_ROWS:
        row = tl.load(rows_ptr + t).to(tl.int64)
    else:
        row = t
    base = row * (KV_HEADS * HEAD_DIM)
    _store_rows(k_ptr, dst_k_ptr, k_scale_ptr, t, base, stride_kt, stride_kh, heads, dims, mask,
                KV_HEADS, HEAD_DIM, SCALED, LARGEST, MANTISSA, MIN_EXP)
    _store_rows(v_ptr, dst_v_ptr, v_scale_ptr, t, base, stride_vt, stride_vh, heads, dims, mask,
                KV_HEADS, HEAD_DIM, SCALED, LARGEST, MANTISSA, MIN_EXP)


def write_kv_triton(dst_k: Tensor, dst_v: Tensor, rows: Tensor | None, k: Tensor, v: Tensor,
                    scales: tuple[Tensor, Tensor] | None) -> None:
    """k/v [T, kv_heads, head_dim] (unit last stride) into dst rows `rows` [T] (None: rows
    0..T-1) of dst [..., kv_heads, head_dim], contiguous in its last two dimensions."""
    n, kv_heads, head_dim = k.shape
    if n == 0:
        return
    scaled = scales is not None
    largest = torch.finfo(dst_k.dtype).max if scaled else 0.0
    mantissa, min_exp = FP8_GRIDS.get(dst_k.dtype, (0, 0))
    _write_kv_kernel[(n,)](
        k, v, dst_k, dst_v, rows if rows is not None else k,
        scales[0] if scaled else k, scales[1] if scaled else k,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, H_PAD=triton.next_power_of_2(kv_heads),
        D_PAD=triton.next_power_of_2(head_dim), HAS_ROWS=rows is not None, SCALED=scaled,
        LARGEST=largest, MANTISSA=mantissa, MIN_EXP=min_exp, num_warps=4 if kv_heads * head_dim >= 1024 else 1)


@triton.jit
def _store_head_major_kernel(
    k_ptr, v_ptr, dst_k_ptr, dst_v_ptr, index_ptr, src_rows_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_db, stride_dh, stride_dt,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    src = tl.load(src_rows_ptr + t).to(tl.int64)
    flat = tl.load(index_ptr + t).to(tl.int64)
    heads = tl.arange(0, H_PAD)[:, None]
    dims = tl.arange(0, D_PAD)[None, :]
    mask = (heads < KV_HEADS) & (dims < HEAD_DIM)
    dst = (flat // BLOCK) * stride_db + heads * stride_dh + (flat % BLOCK) * stride_dt + dims
    k = tl.load(k_ptr + src * stride_kt + heads * stride_kh + dims, mask=mask)
    tl.store(dst_k_ptr + dst, k, mask=mask)
    v = tl.load(v_ptr + src * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(dst_v_ptr + dst, v, mask=mask)


def store_head_major_triton(dst_k: Tensor, dst_v: Tensor, dst_index: Tensor, k: Tensor,
                            v: Tensor, src_rows: Tensor) -> None:
    """See astream.ops.kv_write.store_head_major_ref; every tensor needs a unit last
    stride, dst_k and dst_v the same strides, and 8-bit floats come as uint8 views (the
    rows move as bytes)."""
    n = dst_index.shape[0]
    if n == 0:
        return
    _, kv_heads, head_dim = k.shape
    if dst_k.stride() != dst_v.stride():
        raise ValueError("dst_k and dst_v need the same strides")
    if not k.dtype == v.dtype == dst_k.dtype == dst_v.dtype:
        raise ValueError("rows are moved as they are: k, v and dst need one dtype")
    if src_rows.shape[0] != n or any(x.stride(-1) != 1 for x in (dst_k, dst_v, k, v)):
        raise ValueError("need one source row per index and a unit last stride everywhere")
    _store_head_major_kernel[(n,)](
        k, v, dst_k, dst_v, dst_index, src_rows, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), dst_k.stride(0), dst_k.stride(1), dst_k.stride(2), KV_HEADS=kv_heads,
        HEAD_DIM=head_dim, H_PAD=triton.next_power_of_2(kv_heads),
        D_PAD=triton.next_power_of_2(head_dim), BLOCK=dst_k.shape[2],
        num_warps=4 if kv_heads * head_dim >= 1024 else 1)
