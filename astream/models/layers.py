"""The small numerical pieces of a decoder layer: RMSNorm, rotary embedding, SwiGLU."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalize in float32 and cast back before the weight multiply: the order
    # Hugging Face uses, so bf16 results round the same way.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


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

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim], positions [T] int64."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)
