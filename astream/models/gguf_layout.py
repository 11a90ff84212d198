"""Read a GGUF file's header ourselves, once, bounded by the file size.

One pass over the header gives the metadata (`gguf_metadata`: arrays read in bulk, strings
decoded only on demand) and where each tensor lies. The model config and the tokenizer
are both built from this one `GGUFHeader`. Every length field is checked against the
file's end: a truncated file or a corrupt count is a clear "truncated or corrupt" error
naming the file, never a long loop or a failure deep inside numpy.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from dataclasses import dataclass
from math import prod

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from astream.models.dequant import SUPPORTED_QUANT_TYPES
from astream.models.gguf_metadata import ArrayValue, Cursor, LayoutError, StringTable, read_metadata

__all__ = ["SUPPORTED_GGUF_TENSOR_TYPES", "ArrayValue", "GGUFHeader", "StringTable", "TensorInfo",
           "check_gguf_path", "corrupt_file_error", "read_header", "unsupported_type_error"]

SUPPORTED_GGUF_TENSOR_TYPES = tuple(t.name for t in SUPPORTED_QUANT_TYPES)

_MAX_DIMS = 4


@dataclass(slots=True, frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]              # GGML order: the fastest-varying dimension first
    qtype: GGMLQuantizationType
    offset: int                        # from the start of the file
    nbytes: int


@dataclass(slots=True, frozen=True)
class GGUFHeader:
    fields: dict                       # key -> int | float | bool | str | ArrayValue
    tensors: tuple[TensorInfo, ...]
    metadata_digest: str               # sha256 of the bytes up to the end of the key/values


def _check_tensor_layout(cur: Cursor, tensor_count: int, alignment: int) -> list[TensorInfo]:
    infos, tensors = [], []
    for _ in range(tensor_count):
        name = cur.string().decode("utf-8", errors="replace")
        n_dims = cur.u32()
        if n_dims > _MAX_DIMS:
            raise LayoutError(f"tensor {name!r} claims {n_dims} dimensions")
        dims = [cur.u64() for _ in range(n_dims)]
        infos.append((name, dims, cur.u32(), cur.u64()))
    data_start = -(-cur.pos // alignment) * alignment
    for name, dims, raw_type, offset in infos:
        try:
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(raw_type)]
        except (ValueError, KeyError):
            raise _UnknownTensorType(name, raw_type) from None
        if dims and dims[0] % block_size:
            raise LayoutError(f"tensor {name!r} has rows that do not fill whole blocks")
        nbytes = prod(dims) // block_size * type_size
        end = data_start + offset + nbytes
        if end > len(cur.buf):
            raise LayoutError(
                f"tensor {name!r} ends at byte {end} but the file has only {len(cur.buf)} bytes"
            )
        tensors.append(TensorInfo(name, tuple(dims), GGMLQuantizationType(raw_type),
                                  data_start + offset, nbytes))
    return tensors


class _UnknownTensorType(Exception):
    def __init__(self, name: str, raw_type: int) -> None:
        super().__init__(name, raw_type)
        self.name, self.raw_type = name, raw_type


def corrupt_file_error(path: str, reason: object) -> ValueError:
    return ValueError(
        f"GGUF file {path} is truncated or corrupt ({reason}); download or convert it again"
    )


def unsupported_type_error(path: str, tensor: str, type_name: str) -> ValueError:
    return ValueError(
        f"tensor {tensor!r} in {path} has GGUF type {type_name}, which astream cannot dequantize; "
        f"supported tensor types: {', '.join(SUPPORTED_GGUF_TENSOR_TYPES)} "
        "(re-quantize the model to one of them)"
    )


def check_gguf_path(path: str | os.PathLike) -> str:
    """`path` as a string, or FileNotFoundError / ValueError when it is not a file."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if not os.path.isfile(path):
        raise ValueError(f"GGUF path {path} is not a regular file")
    return path


def read_header(path: str) -> GGUFHeader:
    """The metadata and tensor layout of a GGUF file, checked against its size."""
    if os.path.getsize(path) == 0:
        raise corrupt_file_error(path, "the file is empty")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = Cursor(buf)
        try:
            fields, tensor_count = read_metadata(cur)
            digest = hashlib.sha256(buf[:cur.pos]).hexdigest()
            tensors = _check_tensor_layout(cur, tensor_count, _alignment(fields))
        except LayoutError as exc:
            raise corrupt_file_error(path, exc) from None
        except _UnknownTensorType as exc:
            raise unsupported_type_error(path, exc.name, f"id {exc.raw_type}") from None
    return GGUFHeader(fields, tuple(tensors), digest)


def _alignment(fields: dict) -> int:
    alignment = fields.get("general.alignment", 32)
    if isinstance(alignment, bool) or not isinstance(alignment, int):
        return 32
    if alignment <= 0 or alignment & (alignment - 1):
        raise LayoutError(f"general.alignment {alignment} is not a power of two")
    return alignment
