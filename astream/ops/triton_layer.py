"""Fused Triton kernels for the element-wise parts of a decoder layer (CUDA; also runs
under TRITON_INTERPRET=1). References and contracts: astream.ops.layer_ref.

A decode step of a small batch is a chain of tiny kernels whose cost is their number, not
their bytes: torch's RMSNorm alone is eight launches. Each kernel here is one launch for
what the reference does in several, and rounds to the model's dtype wherever the reference
does, so results agree with it to the last bit but for reduction order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _round_mul(a, b, dtype: tl.constexpr):
    """a * b as a model-dtype op: exact in float32, rounded once to `dtype`."""
    return (a.to(tl.float32) * b.to(tl.float32)).to(dtype).to(tl.float32)


@triton.jit
def _add_rms_norm_kernel(
    res_ptr, delta_ptr, w_ptr, out_ptr, sum_ptr,
    stride_res, stride_delta, stride_out, stride_sum, n_cols, eps,
    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
    dtype: tl.constexpr = res_ptr.dtype.element_ty
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_delta + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(dtype)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = _round_mul(w, (xf * rstd).to(dtype), out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, y, mask=mask)


def add_rms_norm_triton(residual: Tensor, delta: Tensor | None, weight: Tensor,
                        eps: float) -> tuple[Tensor, Tensor]:
    """See layer_ref.add_rms_norm_ref; rows [T, hidden] with a unit column stride."""
    n_cols = residual.shape[-1]
    x = residual.reshape(-1, n_cols)
    out = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
    total = x if delta is None else torch.empty_like(x)
    d = x if delta is None else delta.reshape(-1, n_cols)
    if x.shape[0]:
        block = triton.next_power_of_2(n_cols)
        _add_rms_norm_kernel[(x.shape[0],)](
            x, d, weight, out, total, x.stride(0), d.stride(0), out.stride(0), total.stride(0),
            n_cols, eps, HAS_DELTA=delta is not None, BLOCK=block,
            num_warps=min(16, max(1, block // 256)))
    return out.view(residual.shape), total.view(residual.shape)


@triton.jit
def _qkv_rope_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, q_ptr, k_ptr,
    stride_qkv, stride_table, eps,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr, HAS_NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half: tl.constexpr = HEAD_DIM // 2
    i = tl.arange(0, HALF_PAD)
    mask = i < half
    src = qkv_ptr + t * stride_qkv + head * HEAD_DIM
    x1 = tl.load(src + i, mask=mask, other=0.0)
    x2 = tl.load(src + half + i, mask=mask, other=0.0)
    dtype: tl.constexpr = qkv_ptr.dtype.element_ty
    if HAS_NORM:
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        rstd = tl.math.rsqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / HEAD_DIM + eps)
        if head < HEADS:
            w1 = tl.load(q_norm_ptr + i, mask=mask, other=0.0)
            w2 = tl.load(q_norm_ptr + half + i, mask=mask, other=0.0)
        else:
            w1 = tl.load(k_norm_ptr + i, mask=mask, other=0.0)
            w2 = tl.load(k_norm_ptr + half + i, mask=mask, other=0.0)
        x1 = _round_mul(w1, (f1 * rstd).to(dtype), dtype).to(dtype)
        x2 = _round_mul(w2, (f2 * rstd).to(dtype), dtype).to(dtype)
    row = tl.load(pos_ptr + t).to(tl.int64) * stride_table
    cos1 = tl.load(cos_ptr + row + i, mask=mask, other=0.0)
    cos2 = tl.load(cos_ptr + row + half + i, mask=mask, other=0.0)
    sin1 = tl.load(sin_ptr + row + i, mask=mask, other=0.0)
    sin2 = tl.load(sin_ptr + row + half + i, mask=mask, other=0.0)
    # x * cos + rotate_half(x) * sin, each product and the sum rounded as the reference does
    # (rounding is symmetric, so negating the rounded product equals rounding -x2 * sin).
    out1 = (_round_mul(x1, cos1, dtype) - _round_mul(x2, sin1, dtype)).to(dtype)
    out2 = (_round_mul(x2, cos2, dtype) + _round_mul(x1, sin2, dtype)).to(dtype)
    if head < HEADS:
        dst = q_ptr + (t * HEADS + head) * HEAD_DIM
    else:
        dst = k_ptr + (t * KV_HEADS + head - HEADS) * HEAD_DIM
    tl.store(dst + i, out1, mask=mask)
    tl.store(dst + half + i, out2, mask=mask)


def qkv_rope_triton(qkv: Tensor, positions: Tensor, cos_table: Tensor, sin_table: Tensor,
                    heads: int, kv_heads: int, q_norm: Tensor | None, k_norm: Tensor | None,
                    eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """See layer_ref.qkv_rope_ref; one launch writes q and k, v stays a view of qkv."""
    n = qkv.shape[0]
    head_dim = qkv.shape[-1] // (heads + 2 * kv_heads)
    q = torch.empty(n, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(n, kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(n, kv_heads, head_dim)
    if n:
        has_norm = q_norm is not None
        _qkv_rope_kernel[(n, heads + kv_heads)](
            qkv, positions, cos_table, sin_table, q_norm if has_norm else qkv,
            k_norm if has_norm else qkv, q, k, qkv.stride(0), cos_table.stride(0), eps,
            HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
            HALF_PAD=triton.next_power_of_2(head_dim // 2), HAS_NORM=has_norm,
            num_warps=1 if head_dim <= 128 else 2,
            # A fused multiply-add would skip rounding one product, which the reference rounds
            # (measured on the H100: 22% of bf16 q/k elements differed with fusion on).
            enable_fp_fusion=False)
    return q, k, v


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, n_cols, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_up_ptr + t * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + t * stride_in + n_cols + cols, mask=mask, other=0.0)
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype)
    tl.store(out_ptr + t * stride_out + cols, _round_mul(act, up, dtype).to(dtype), mask=mask)


def silu_mul_triton(gate_up: Tensor) -> Tensor:
    """See layer_ref.silu_mul_ref; gate_up [T, 2*I] with a unit column stride."""
    n_cols = gate_up.shape[-1] // 2
    out = torch.empty(gate_up.shape[0], n_cols, dtype=gate_up.dtype, device=gate_up.device)
    if gate_up.shape[0]:
        block = min(1024, triton.next_power_of_2(n_cols))
        _silu_mul_kernel[(gate_up.shape[0], triton.cdiv(n_cols, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), n_cols, BLOCK=block, num_warps=4)
    return out
