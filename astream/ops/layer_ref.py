"""Torch references for the element-wise parts of a decoder layer.

These are the decoder's own math on the CPU and the oracle of the fused Triton kernels
(ops.triton_layer). Each rounds to the model's dtype where the Hugging Face models do,
op by op, so bf16 results match theirs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # Normalize in float32 and cast back before the weight multiply: the order
    # Hugging Face uses, so bf16 results round the same way.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_ref(residual: Tensor, delta: Tensor | None, weight: Tensor,
                     eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(residual + delta), residual + delta); no add when delta is None."""
    if delta is not None:
        residual = residual + delta
    return rms_norm_ref(residual, weight, eps), residual


def rotate_ref(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding, rotate-half layout: x [T, heads, D], cos/sin [T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def qkv_rope_ref(qkv: Tensor, positions: Tensor, cos_table: Tensor, sin_table: Tensor,
                 heads: int, kv_heads: int, q_norm: Tensor | None, k_norm: Tensor | None,
                 eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Split a QKV projection [T, (heads + 2*kv_heads) * D] into q [T, heads, D], k and v
    [T, kv_heads, D]; per-head RMSNorm of q and k when given their weights (Qwen3), then
    RoPE at `positions` [T]. v is a view into `qkv`."""
    head_dim = qkv.shape[-1] // (heads + 2 * kv_heads)
    q, k, v = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    q = q.view(-1, heads, head_dim)
    k = k.view(-1, kv_heads, head_dim)
    v = v.reshape(-1, kv_heads, head_dim)
    if q_norm is not None:
        q = rms_norm_ref(q, q_norm, eps)
        k = rms_norm_ref(k, k_norm, eps)
    cos, sin = cos_table[positions], sin_table[positions]
    return rotate_ref(q, cos, sin), rotate_ref(k, cos, sin), v


def silu_mul_ref(gate_up: Tensor) -> Tensor:
    """SwiGLU's activation: silu(gate) * up for gate_up [T, 2*I] (gate columns first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
