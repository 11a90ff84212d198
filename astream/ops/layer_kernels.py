"""The element-wise kernels of a decoder layer one engine uses, chosen once when the model
is loaded: the fused Triton kernels on CUDA (ops.triton_layer), the torch references
elsewhere (ops.layer_ref). The decoder calls through `LayerKernels`, so no layer decides.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from astream.ops import layer_ref


@functools.cache
def _triton_importable() -> bool:
    try:
        import astream.ops.triton_layer  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(slots=True, frozen=True)
class LayerKernels:
    name: str = "reference"             # "triton" | "reference"

    @classmethod
    def select(cls, device: torch.device | str) -> "LayerKernels":
        fused = torch.device(device).type == "cuda" and _triton_importable()
        return cls("triton" if fused else "reference")

    def add_rms_norm(self, residual: Tensor, delta: Tensor | None, weight: Tensor,
                     eps: float) -> tuple[Tensor, Tensor]:
        """(rms_norm(residual + delta), residual + delta); no add when delta is None."""
        if self.name == "triton" and residual.stride(-1) == 1 and (delta is None or delta.stride(-1) == 1):
            from astream.ops import triton_layer

            return triton_layer.add_rms_norm_triton(residual, delta, weight, eps)
        return layer_ref.add_rms_norm_ref(residual, delta, weight, eps)

    def qkv_rope(self, qkv: Tensor, positions: Tensor, cos_table: Tensor, sin_table: Tensor,
                 heads: int, kv_heads: int, q_norm: Tensor | None, k_norm: Tensor | None,
                 eps: float) -> tuple[Tensor, Tensor, Tensor]:
        """q, k (normed when given q/k norm weights, rotated) and v from a QKV projection."""
        if self.name == "triton" and qkv.stride(-1) == 1:
            from astream.ops import triton_layer

            return triton_layer.qkv_rope_triton(qkv, positions, cos_table, sin_table, heads,
                                                kv_heads, q_norm, k_norm, eps)
        return layer_ref.qkv_rope_ref(qkv, positions, cos_table, sin_table, heads, kv_heads,
                                      q_norm, k_norm, eps)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        if self.name == "triton" and gate_up.stride(-1) == 1:
            from astream.ops import triton_layer

            return triton_layer.silu_mul_triton(gate_up)
        return layer_ref.silu_mul_ref(gate_up)
