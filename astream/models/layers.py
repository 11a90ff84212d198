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
        positions = torch.arange(max_positions, device=device, dtype=torch.float64)
        return cls(*rotary_cos_sin(positions, head_dim, theta, scaling_factor, dtype))


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, scaling_factor: float,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [len(positions), head_dim] in `dtype`, rotate-half layout."""
    # Angles in float64: in float32, position x frequency near a million positions is off
    # by up to 1/16 rad (a float32 there is a multiple of 1/8), and a table is built once.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim
    inv_freq = 1.0 / (theta ** exponents) / scaling_factor
    freqs = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
