"""How K and V are stored: the cache's element type and, for 8-bit floats, the scales.

`KVFormat` is shared by every KV container (the paged cache, the host pool and its ring,
staging buffers and tails) and by the attention adapters, so each tensor that holds KV is
written by `quantize` and read through `dequantize` or a kernel given `scales(layer)`.

FP8 scales are per (layer, KV head), one for K and one for V: stored = value / scale,
saturated to the format's largest finite number. They are fixed when the engine is built
(astream.kvcache.calibration), never changed afterwards, so every request sees the same
scales whatever ran before it, a captured CUDA graph reads constants, and a cached prefix
block means the same thing to every later request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


class KVScales(NamedTuple):
    """One layer's dequantization scales, [kv_heads] float32 each: value = stored * scale."""

    k: Tensor
    v: Tensor


@dataclass(slots=True, frozen=True)
class KVFormat:
    dtype: torch.dtype                   # what the KV tensors hold
    compute_dtype: torch.dtype           # what attention reads (the model's dtype)
    k_scale: Tensor | None = None        # [layers, kv_heads] float32; None: no scaling
    v_scale: Tensor | None = None

    @classmethod
    def plain(cls, dtype: torch.dtype) -> "KVFormat":
        """KV stored as the model computes it: reads and writes are plain copies."""
        return cls(dtype, dtype)

    @property
    def scaled(self) -> bool:
        return self.k_scale is not None

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    def scales(self, layer: int) -> KVScales | None:
        return KVScales(self.k_scale[layer], self.v_scale[layer]) if self.scaled else None

    def quantize(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """K/V rows [..., kv_heads, head_dim] as stored."""
        if not self.scaled:
            return k.to(self.dtype), v.to(self.dtype)
        return (_scale_down(k, self.k_scale[layer], self.dtype),
                _scale_down(v, self.v_scale[layer], self.dtype))

    def dequantize(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Stored K/V [..., kv_heads, head_dim] in the compute dtype."""
        if not self.scaled:
            return k.to(self.compute_dtype), v.to(self.compute_dtype)
        return (_scale_up(k, self.k_scale[layer], self.compute_dtype),
                _scale_up(v, self.v_scale[layer], self.compute_dtype))

    def read_keys(self, layer: int, stored: Tensor) -> Tensor:
        """Stored keys [..., kv_heads, head_dim] as a read returns them, in the compute dtype
        (what a policy's key statistics must describe)."""
        if not self.scaled:
            return stored.to(self.compute_dtype)
        return _scale_up(stored, self.k_scale[layer], self.compute_dtype)


def _scale_down(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    # Saturate: a float8 cast of an out-of-range value gives NaN (e4m3fn) or inf (e5m2).
    largest = torch.finfo(dtype).max
    return (x.float() / scale.unsqueeze(-1)).clamp_(-largest, largest).to(dtype)


def _scale_up(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return (x.float() * scale.unsqueeze(-1)).to(dtype)


def as_bytes(x: Tensor) -> Tensor:
    """A float8 tensor viewed as uint8 (same shape), anything else as itself: some index ops
    (index_copy_ on the CPU) have no float8 kernels, and moving bytes is all they do."""
    return x.view(torch.uint8) if is_fp8(x.dtype) else x
