"""Dequantization of GGUF (ggml) tensor data with torch tensor ops.

Every function works on whole tensors at once (no Python loop over blocks), so
the same code runs on CPU and on CUDA: move the raw bytes to the GPU first and
the dequantization runs there.

Block layouts (little-endian, as written by ggml):

* Q4_0 (32 values, 18 bytes): fp16 d, 16 bytes of nibbles; x = d * (q - 8).
  Byte j holds value j in its low nibble and value j + 16 in its high nibble.
* Q4_1 (32 values, 20 bytes): fp16 d, fp16 m, 16 bytes of nibbles; x = d * q + m.
* Q5_0 (32 values, 22 bytes): fp16 d, 32 high bits (a little-endian uint32,
  bit j for value j), nibbles as in Q4_0; x = d * (q - 16).
* Q5_1 (32 values, 24 bytes): fp16 d, fp16 m, high bits, nibbles; x = d * q + m.
  (llama.cpp falls back to Q5_0/Q5_1/Q8_0 for rows that are not a multiple of
  256, e.g. the 896-wide matrices of Qwen2.5-0.5B in a "Q4_K_M" file.)
* Q8_0 (32 values, 34 bytes): fp16 d, 32 int8; x = d * q.
* Q4_K (256 values, 144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit packed
  scales and mins for 8 sub-blocks of 32, 128 bytes of nibbles (each 32-byte
  chunk gives one sub-block in its low nibbles and the next in its high ones);
  x = d * scale * q - dmin * min.
* Q5_K (256 values, 176 bytes): as Q4_K plus 32 bytes of high bits placed
  between the scales and the nibbles; bit i of byte l is the fifth bit of value
  l of sub-block i.
* Q6_K (256 values, 210 bytes): 128 bytes of low nibbles, 64 bytes of 2-bit
  high parts, 16 int8 scales (one per 16 values), fp16 d at the end;
  x = d * scale * (q - 32).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from math import prod
from types import MappingProxyType

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256
_K_SCALE_BYTES = 12

BlockFn = Callable[[torch.Tensor], torch.Tensor]


def _fp16(cols: torch.Tensor) -> torch.Tensor:
    """(n, 2) uint8 holding one little-endian fp16 per row -> (n, 1) float32."""
    return cols.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., k) uint8 -> (..., 2, k): low nibbles first, then high nibbles."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def _shift_bits(x: torch.Tensor, shifts: Sequence[int], mask: int) -> torch.Tensor:
    """(..., k) uint8 -> (..., len(shifts), k) with (x >> s) & mask for each s."""
    s = torch.tensor(shifts, dtype=torch.uint8, device=x.device).view(-1, 1)
    return (x.unsqueeze(-2) >> s) & mask


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _fp16(blocks[:, :2])
    q = _nibbles(blocks[:, 2:]).reshape(blocks.shape[0], 32)
    return d * (q.float() - 8.0)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _fp16(blocks[:, :2]), _fp16(blocks[:, 2:4])
    q = _nibbles(blocks[:, 4:]).reshape(blocks.shape[0], 32)
    return d * q.float() + m


def _q5_high_bits(qh: torch.Tensor) -> torch.Tensor:
    """(n, 4) uint8, a little-endian uint32 per block -> (n, 32): bit i of it at i."""
    bits = _shift_bits(qh, range(8), 0x01)  # (n, bit, byte)
    return bits.transpose(1, 2).reshape(qh.shape[0], 32)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _fp16(blocks[:, :2])
    low = _nibbles(blocks[:, 6:]).reshape(blocks.shape[0], 32)
    q = low | (_q5_high_bits(blocks[:, 2:6]) << 4)
    return d * (q.float() - 16.0)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _fp16(blocks[:, :2]), _fp16(blocks[:, 2:4])
    low = _nibbles(blocks[:, 8:]).reshape(blocks.shape[0], 32)
    q = low | (_q5_high_bits(blocks[:, 4:8]) << 4)
    return d * q.float() + m


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _fp16(blocks[:, :2])
    q = blocks[:, 2:].contiguous().view(torch.int8)
    return d * q.float()


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte 6-bit scales/mins of Q4_K/Q5_K into (n, 8) each.

    Sub-blocks 0-3 use the low 6 bits of bytes 0-3 (scales) and 4-7 (mins);
    sub-blocks 4-7 take their low 4 bits from the nibbles of bytes 8-11 and
    their top 2 bits from the top 2 bits of bytes 0-3 / 4-7.
    """
    sc_lo, mn_lo, extra = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat((sc_lo & 0x3F, (extra & 0x0F) | ((sc_lo >> 2) & 0x30)), dim=1)
    mins = torch.cat((mn_lo & 0x3F, (extra >> 4) | ((mn_lo >> 2) & 0x30)), dim=1)
    return scales.float(), mins.float()


def _k_affine(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Apply Q4_K/Q5_K's d * scale * q - dmin * min to q of shape (n, 8, 32)."""
    d, dmin = _fp16(blocks[:, :2]), _fp16(blocks[:, 2:4])
    scales, mins = _k_scales_mins(blocks[:, 4 : 4 + _K_SCALE_BYTES])
    out = (d * scales).unsqueeze(-1) * q.float() - (dmin * mins).unsqueeze(-1)
    return out.reshape(blocks.shape[0], QK_K)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    qs = blocks[:, 4 + _K_SCALE_BYTES :].reshape(n, 4, 32)
    return _k_affine(blocks, _nibbles(qs).reshape(n, 8, 32))


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    start = 4 + _K_SCALE_BYTES
    qh = blocks[:, start : start + QK_K // 8]
    qs = blocks[:, start + QK_K // 8 :].reshape(n, 4, 32)
    low = _nibbles(qs).reshape(n, 8, 32)
    high = _shift_bits(qh, range(8), 0x01)
    return _k_affine(blocks, low | (high << 4))


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql = blocks[:, : QK_K // 2].reshape(n, 2, 64)
    qh = blocks[:, QK_K // 2 : QK_K // 2 + QK_K // 4].reshape(n, 2, 32)
    scales = blocks[:, QK_K // 2 + QK_K // 4 : -2].contiguous().view(torch.int8)
    d = _fp16(blocks[:, -2:])
    # Each 128-value half: 4 groups of 32; group g uses nibble g // 2 of ql
    # bytes (g % 2) * 32 + l and bits 2g..2g+1 of qh byte l.
    low = _nibbles(ql).reshape(n, 2, 4, 32)
    high = _shift_bits(qh, (0, 2, 4, 6), 0x03)
    q = (low | (high << 4)).float() - 32.0
    out = (d * scales.float()).unsqueeze(-1) * q.reshape(n, QK_K // 16, 16)
    return out.reshape(n, QK_K)


def _plain(torch_dtype: torch.dtype) -> BlockFn:
    def convert(raw: torch.Tensor) -> torch.Tensor:
        return raw.contiguous().view(torch_dtype).float()

    return convert


_BLOCK_FNS: MappingProxyType[GGMLQuantizationType, BlockFn] = MappingProxyType(
    {
        GGMLQuantizationType.F32: _plain(torch.float32),
        GGMLQuantizationType.F16: _plain(torch.float16),
        GGMLQuantizationType.BF16: _plain(torch.bfloat16),
        GGMLQuantizationType.Q8_0: _q8_0,
        GGMLQuantizationType.Q4_0: _q4_0,
        GGMLQuantizationType.Q4_1: _q4_1,
        GGMLQuantizationType.Q5_0: _q5_0,
        GGMLQuantizationType.Q5_1: _q5_1,
        GGMLQuantizationType.Q4_K: _q4_k,
        GGMLQuantizationType.Q5_K: _q5_k,
        GGMLQuantizationType.Q6_K: _q6_k,
    }
)

SUPPORTED_QUANT_TYPES: tuple[GGMLQuantizationType, ...] = tuple(_BLOCK_FNS)


def quantized_nbytes(qtype: GGMLQuantizationType | int, shape: Sequence[int]) -> int:
    """Bytes that a tensor of logical `shape` takes when stored as `qtype`."""
    qtype = GGMLQuantizationType(qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    row = shape[-1] if shape else 1
    if row % block_size:
        raise ValueError(
            f"rows of {row} values are not a multiple of the {qtype.name} block size {block_size}"
        )
    return prod(shape) // block_size * type_size


def dequantize(
    data: torch.Tensor,
    qtype: GGMLQuantizationType | int,
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize raw ggml bytes into a new float tensor of `shape` and `dtype`.

    `data` holds the tensor's bytes as uint8 (any shape, contiguous or not) on
    the device where the work should run; `shape` is the logical shape in torch
    order (ggml's dimensions reversed). Computes in float32, then casts.
    """
    qtype = GGMLQuantizationType(qtype)
    fn = _BLOCK_FNS.get(qtype)
    if fn is None:
        supported = ", ".join(t.name for t in SUPPORTED_QUANT_TYPES)
        raise ValueError(f"cannot dequantize ggml type {qtype.name}; supported types: {supported}")
    if data.dtype != torch.uint8:
        raise TypeError(f"expected raw bytes as a uint8 tensor, got {data.dtype}")
    shape = tuple(int(s) for s in shape)
    nbytes = quantized_nbytes(qtype, shape)
    if data.numel() != nbytes:
        raise ValueError(
            f"{qtype.name} tensor of shape {list(shape)} needs {nbytes} bytes, got {data.numel()}"
        )
    type_size = GGML_QUANT_SIZES[qtype][1]
    blocks = data.reshape(-1, type_size)
    out = fn(blocks).reshape(shape)
    # The float types may come back as a view of `data` (F32 read as float32);
    # callers get a tensor of their own, never an alias of a memory map.
    if out.data_ptr() == data.data_ptr() or out.dtype != dtype:
        out = out.to(dtype=dtype, copy=True)
    return out
