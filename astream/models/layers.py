"""The rotary table a decoder reads; the layer's element-wise math lives in ops
(ops.layer_ref for the torch references, ops.triton_layer for the fused kernels)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class RotaryTable:
    """cos/sin for every position up to max_positions, rotate-half layout."""

    cos: torch.Tensor   # [max_positions, head_dim] in the model dtype
    sin: torch.Tensor

    @classmethod
    def build(cls, head_dim: int, max_positions: int, theta: float, scaling_factor: float,
              dtype: torch.dtype, device: torch.device) -> "RotaryTable":
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                                 device=device).float() / head_dim))
        inv_freq = inv_freq / scaling_factor
        positions = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return cls(cos=angles.cos().to(dtype), sin=angles.sin().to(dtype))
