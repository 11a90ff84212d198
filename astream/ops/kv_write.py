"""Writing K/V rows into KV storage, quantizing on the way for 8-bit floats.

Stored = value / scale, saturated to the storage type's largest finite number, with one
scale per KV head; value = stored * scale reads it back. `write_kv` scatters rows into a
cache at given rows and `quantize_kv` returns them as new tensors. `store_head_major`
moves rows already stored (a subset of them) into head-major block buffers (the offload
engine's staging and tails). On CUDA each is one Triton launch for K and V together
(ops.triton_kv_write); elsewhere they are these torch references, which are also the
kernels' oracle.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

Scales = tuple[Tensor, Tensor] | None       # (k, v) [kv_heads] float32, or None: no scaling


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def as_bytes(x: Tensor) -> Tensor:
    """A float8 tensor viewed as uint8 (same shape), anything else as itself: some index ops
    (index_copy_ on the CPU) have no float8 kernels, and moving bytes is all they do."""
    return x.view(torch.uint8) if is_fp8(x.dtype) else x


def quantize_ref(x: Tensor, scale: Tensor | None, dtype: torch.dtype) -> Tensor:
    """Rows [..., kv_heads, head_dim] as stored in `dtype`, divided by their head's scale."""
    if scale is None:
        return x.to(dtype)
    # Saturate: a float8 cast of an out-of-range value gives NaN (e4m3fn) or inf (e5m2).
    largest = torch.finfo(dtype).max
    return (x.float() / scale.unsqueeze(-1)).clamp_(-largest, largest).to(dtype)


def dequantize_ref(x: Tensor, scale: Tensor | None, dtype: torch.dtype) -> Tensor:
    if scale is None:
        return x.to(dtype)
    # Into `dtype` first (every fp8 value is exact there), then scaled in place: the product
    # is still formed in float32 and rounded once, with no float32 copy of x (a million
    # keys' K would take 4 GiB). The result is contiguous whatever x's strides.
    out = torch.empty(x.shape, dtype=dtype, device=x.device).copy_(x)
    return out.mul_(scale.unsqueeze(-1))


def write_kv_ref(dst_k: Tensor, dst_v: Tensor, rows: Tensor, k: Tensor, v: Tensor,
                 scales: Scales = None) -> None:
    """Store k/v [T, kv_heads, head_dim] at flat rows [T] of dst [..., kv_heads, head_dim]
    (a paged cache's slots: block * block_size + offset)."""
    for dst, src, scale in ((dst_k, k, scales and scales[0]), (dst_v, v, scales and scales[1])):
        stored = quantize_ref(src, scale, dst.dtype)
        as_bytes(dst).view(-1, *src.shape[1:]).index_copy_(0, rows, as_bytes(stored))


def store_head_major_ref(dst_k: Tensor, dst_v: Tensor, dst_index: Tensor, k: Tensor, v: Tensor,
                         src_rows: Tensor) -> None:
    """Rows src_rows [N] of k/v [T, kv_heads, head_dim] (already in dst's dtype) into
    head-major block buffers dst [blocks, kv_heads, block_size, head_dim] at flat token
    positions dst_index [N] (block * block_size + offset)."""
    block_size = dst_k.shape[2]
    blocks, offsets = dst_index // block_size, dst_index % block_size
    for dst, src in ((dst_k, k), (dst_v, v)):
        as_bytes(dst).transpose(1, 2).index_put_((blocks, offsets), as_bytes(src.index_select(0, src_rows)))


@functools.cache
def _triton_importable() -> bool:
    try:
        import astream.ops.triton_kv_write  # noqa: F401
    except ImportError:
        return False
    return True


def _use_triton(x: Tensor) -> bool:
    return x.is_cuda and _triton_importable()


def write_kv(dst_k: Tensor, dst_v: Tensor, rows: Tensor, k: Tensor, v: Tensor,
             scales: Scales = None) -> None:
    """See write_kv_ref; dst must be contiguous in its last two dimensions."""
    if _use_triton(dst_k):
        from astream.ops import triton_kv_write

        triton_kv_write.write_kv_triton(dst_k, dst_v, rows, k, v, scales)
        return
    write_kv_ref(dst_k, dst_v, rows, k, v, scales)


def store_head_major(dst_k: Tensor, dst_v: Tensor, dst_index: Tensor, k: Tensor, v: Tensor,
                     src_rows: Tensor) -> None:
    """See store_head_major_ref (six torch launches for one layer's tails, one here)."""
    if _use_triton(dst_k):
        from astream.ops import triton_kv_write

        triton_kv_write.store_head_major_triton(*(as_bytes(x) for x in (dst_k, dst_v)), dst_index,
                                                *(as_bytes(x) for x in (k, v)), src_rows)
        return
    store_head_major_ref(dst_k, dst_v, dst_index, k, v, src_rows)


def quantize_kv(k: Tensor, v: Tensor, scales: Scales, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """K/V rows [..., kv_heads, head_dim] as stored in `dtype` (new tensors, or k and v
    themselves when nothing changes)."""
    if scales is None and k.dtype == dtype and v.dtype == dtype:
        return k, v
    if _use_triton(k) and k.dim() == 3:
        from astream.ops import triton_kv_write

        stored_k = torch.empty(k.shape, dtype=dtype, device=k.device)
        stored_v = torch.empty(v.shape, dtype=dtype, device=v.device)
        triton_kv_write.write_kv_triton(stored_k, stored_v, None, k, v, scales)
        return stored_k, stored_v
    return (quantize_ref(k, scales and scales[0], dtype),
            quantize_ref(v, scales and scales[1], dtype))
