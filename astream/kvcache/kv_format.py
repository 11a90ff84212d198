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

from astream.ops.kv_write import FP8_DTYPES, as_bytes, dequantize_ref, is_fp8, quantize_kv

__all__ = ["FP8_DTYPES", "KVFormat", "KVScales", "as_bytes", "is_fp8"]


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
        return quantize_kv(k, v, self.scales(layer), self.dtype)

    def dequantize(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Stored K/V [..., kv_heads, head_dim] in the compute dtype."""
        scales = self.scales(layer)
        return (dequantize_ref(k, scales and scales.k, self.compute_dtype),
                dequantize_ref(v, scales and scales.v, self.compute_dtype))
