"""Read a GGUF file's header ourselves, bounded by the file size.

One pass over the header gives the metadata values and where each tensor lies; arrays
(a vocabulary of 151K strings) are skipped, never decoded, so this takes milliseconds
where gguf's per-field reader takes seconds. Every length field is checked against the
file's end: a truncated file or a corrupt count is a clear "truncated or corrupt" error
naming the file, never a long loop or a failure deep inside numpy.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from math import prod
from types import MappingProxyType

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from astream.models.dequant import SUPPORTED_QUANT_TYPES

SUPPORTED_GGUF_TENSOR_TYPES = tuple(t.name for t in SUPPORTED_QUANT_TYPES)

_SCALAR_SIZES = MappingProxyType(
    {
        GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1,
        GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
        GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
        GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
    }
)
_MAX_DIMS = 4
_FORMATS = MappingProxyType(
    {
        GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.BOOL: "<?",
        GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I",
        GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.UINT64: "<Q",
        GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
    }
)


@dataclass(slots=True, frozen=True)
class ArrayValue:
    """A metadata array, not decoded: its item type and length."""

    item_type: int                     # a GGUFValueType number
    count: int


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


class _LayoutError(Exception):
    """The file's own length fields point past its end or make no sense."""


class _Cursor:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> int:
        if n < 0 or self.pos + n > len(self.buf):
            raise _LayoutError(
                f"a field at byte {self.pos} needs {n} bytes but the file ends at byte {len(self.buf)}"
            )
        start, self.pos = self.pos, self.pos + n
        return start

    def u32(self) -> int:
        return struct.unpack_from("<I", self.buf, self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack_from("<Q", self.buf, self.take(8))[0]

    def string(self) -> bytes:
        n = self.u64()
        start = self.take(n)
        return self.buf[start : start + n]


def _skip_value(cur: _Cursor, raw_type: int) -> None:
    try:
        vtype = GGUFValueType(raw_type)
    except ValueError:
        raise _LayoutError(f"unknown metadata value type {raw_type} at byte {cur.pos}") from None
    if vtype == GGUFValueType.STRING:
        cur.take(cur.u64())
    elif vtype == GGUFValueType.ARRAY:
        item_type, count = cur.u32(), cur.u64()
        if item_type in _SCALAR_SIZES:
            cur.take(count * _SCALAR_SIZES[GGUFValueType(item_type)])
        else:
            for _ in range(count):  # each item takes >= 8 bytes, so this ends with the file
                _skip_value(cur, item_type)
    else:
        cur.take(_SCALAR_SIZES[vtype])


def _read_value(cur: _Cursor, raw_type: int):
    """One metadata value: scalars and strings decoded, arrays skipped (their length kept)."""
    try:
        vtype = GGUFValueType(raw_type)
    except ValueError:
        raise _LayoutError(f"unknown metadata value type {raw_type} at byte {cur.pos}") from None
    if vtype == GGUFValueType.STRING:
        return bytes(cur.string()).decode("utf-8", errors="replace")
    if vtype == GGUFValueType.ARRAY:
        start = cur.pos
        item_type, count = cur.u32(), cur.u64()
        cur.pos = start
        _skip_value(cur, raw_type)
        return ArrayValue(item_type, count)
    value = struct.unpack_from(_FORMATS[vtype], cur.buf, cur.take(_SCALAR_SIZES[vtype]))[0]
    if vtype == GGUFValueType.FLOAT32:       # shortest float32 repr: 1e-05, not 9.99999974e-06
        value = float(str(np.float32(value)))
    return value


def _read_metadata_layout(cur: _Cursor, fields: dict | None = None) -> tuple[int, int]:
    """Check magic, version and key/values (kept in `fields`); return (tensor_count, alignment)."""
    start = cur.take(4)
    if cur.buf[start : start + 4] != b"GGUF":
        raise _LayoutError("it does not start with the GGUF magic bytes")
    version = cur.u32()
    if version & 0xFFFF == 0:
        raise _LayoutError("it is a big-endian GGUF file, which astream cannot read")
    if version not in (2, 3):
        raise _LayoutError(f"GGUF version {version} is not supported (2 and 3 are)")
    tensor_count, kv_count = cur.u64(), cur.u64()
    alignment = 32
    for _ in range(kv_count):
        key = bytes(cur.string()).decode("utf-8", errors="replace")
        raw_type = cur.u32()
        if fields is None and key != "general.alignment":
            _skip_value(cur, raw_type)
            continue
        value = _read_value(cur, raw_type)
        if fields is not None:
            fields[key] = value
        if key == "general.alignment" and raw_type == GGUFValueType.UINT32:
            alignment = value
    if alignment <= 0 or alignment & (alignment - 1):
        raise _LayoutError(f"general.alignment {alignment} is not a power of two")
    return tensor_count, alignment


def _check_tensor_layout(cur: _Cursor, tensor_count: int, alignment: int) -> list[TensorInfo]:
    infos, tensors = [], []
    for _ in range(tensor_count):
        name = cur.string().decode("utf-8", errors="replace")
        n_dims = cur.u32()
        if n_dims > _MAX_DIMS:
            raise _LayoutError(f"tensor {name!r} claims {n_dims} dimensions")
        dims = [cur.u64() for _ in range(n_dims)]
        infos.append((name, dims, cur.u32(), cur.u64()))
    data_start = -(-cur.pos // alignment) * alignment
    for name, dims, raw_type, offset in infos:
        try:
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(raw_type)]
        except (ValueError, KeyError):
            raise _UnknownTensorType(name, raw_type) from None
        if dims and dims[0] % block_size:
            raise _LayoutError(f"tensor {name!r} has rows that do not fill whole blocks")
        nbytes = prod(dims) // block_size * type_size
        end = data_start + offset + nbytes
        if end > len(cur.buf):
            raise _LayoutError(
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


def validate_layout(path: str) -> None:
    """Raise ValueError unless every header field and tensor lies inside the file."""
    _walk(path, None)


def read_header(path: str) -> GGUFHeader:
    """The metadata and tensor layout of a GGUF file, checked against its size."""
    fields: dict = {}
    tensors = _walk(path, fields)
    return GGUFHeader(fields, tuple(tensors))


def _walk(path: str, fields: dict | None) -> list[TensorInfo]:
    if os.path.getsize(path) == 0:
        raise corrupt_file_error(path, "the file is empty")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf)
        try:
            tensor_count, alignment = _read_metadata_layout(cur, fields)
            return _check_tensor_layout(cur, tensor_count, alignment)
        except _LayoutError as exc:
            raise corrupt_file_error(path, exc) from None
        except _UnknownTensorType as exc:
            raise unsupported_type_error(path, exc.name, f"id {exc.raw_type}") from None


