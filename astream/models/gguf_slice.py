"""The bytes of a GGUF tensor that hold one tensor-parallel slice of it.

ggml stores a tensor as rows of whole quantization blocks along its last (input)
dimension, each block dequantized on its own. A range of rows is therefore one contiguous
byte range, and a range of columns is the same block range of every row (a strided view).
A column range that starts or ends inside a block takes the whole boundary blocks, which
are dequantized and trimmed: the values it keeps are the same as a whole-tensor read gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from astream.models.tensor_parallel import Slice


@dataclass(frozen=True, slots=True)
class BlockSlice:
    """`raw` dequantizes to `shape`; narrowing that by (dim, skip, length) gives the slice."""

    raw: np.ndarray
    shape: tuple[int, ...]
    dim: int
    skip: int
    length: int


def block_slice(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...],
                where: Slice) -> BlockSlice | None:
    """A view of the bytes of `data` (a tensor of `shape`, torch order) that hold `where`;
    None for a layout this does not cut (more than two dimensions)."""
    if not shape or len(shape) > 2:
        return None
    block, type_size = GGML_QUANT_SIZES[qtype]
    cols = shape[-1]
    rows = prod(shape[:-1])
    table = data.reshape(rows, cols // block * type_size)
    length = where.stop - where.start
    if where.dim == len(shape) - 1:
        first, end = where.start // block, -(-where.stop // block)
        raw = table[:, first * type_size:end * type_size]
        return BlockSlice(raw, (*shape[:-1], (end - first) * block), where.dim,
                          where.start - first * block, length)
    return BlockSlice(table[where.start:where.stop], (length, cols), 0, 0, length)
