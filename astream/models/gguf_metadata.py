"""The key/value section of a GGUF file, read in one pass.

Scalars and strings are decoded as they come. Arrays are read in bulk: numbers with one
`np.frombuffer`, strings (a vocabulary of 151K tokens, its merges) by one scan of their
length fields, keeping the bytes and the offsets so that the strings are decoded only
when someone asks (a cached tokenizer never does). Every length is checked against the
file's end, so a corrupt count is an error, never a long loop.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
from gguf import GGUFValueType

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_DTYPES = MappingProxyType(
    {
        GGUFValueType.UINT8: np.dtype("u1"), GGUFValueType.INT8: np.dtype("i1"),
        GGUFValueType.BOOL: np.dtype("?"), GGUFValueType.UINT16: np.dtype("<u2"),
        GGUFValueType.INT16: np.dtype("<i2"), GGUFValueType.UINT32: np.dtype("<u4"),
        GGUFValueType.INT32: np.dtype("<i4"), GGUFValueType.FLOAT32: np.dtype("<f4"),
        GGUFValueType.UINT64: np.dtype("<u8"), GGUFValueType.INT64: np.dtype("<i8"),
        GGUFValueType.FLOAT64: np.dtype("<f8"),
    }
)


class LayoutError(Exception):
    """The file's own length fields point past its end or make no sense."""


class Cursor:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: mmap.mmap | bytes) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> int:
        if n < 0 or self.pos + n > len(self.buf):
            raise LayoutError(
                f"a field at byte {self.pos} needs {n} bytes but the file ends at byte {len(self.buf)}"
            )
        start, self.pos = self.pos, self.pos + n
        return start

    def u32(self) -> int:
        return _U32.unpack_from(self.buf, self.take(4))[0]

    def u64(self) -> int:
        return _U64.unpack_from(self.buf, self.take(8))[0]

    def string(self) -> bytes:
        n = self.u64()
        start = self.take(n)
        return self.buf[start : start + n]


@dataclass(slots=True, frozen=True)
class StringTable:
    """A string array as stored (each item: u64 length, then UTF-8 bytes), not yet decoded."""

    blob: bytes
    heads: np.ndarray                  # count + 1 offsets into blob: each item's length field, then the end

    def __len__(self) -> int:
        return len(self.heads) - 1

    def decode(self) -> list[str]:
        """The strings, decoded at C speed: the items joined by NUL bytes, decoded once, split."""
        count = len(self)
        if count == 0:
            return []
        raw = np.frombuffer(self.blob, np.uint8)
        keep = np.ones(len(raw), dtype=bool)
        keep[(self.heads[:-1, None] + np.arange(7)).ravel()] = False
        joined = raw[keep]                      # each length field shrunk to its last byte ...
        separators = self.heads[:-1] - 7 * np.arange(count)
        joined[separators] = 0                  # ... which becomes a NUL before each item
        if np.count_nonzero(joined == 0) != count:      # some item holds a NUL itself
            return self._decode_one_by_one()
        return joined[1:].tobytes().decode("utf-8", errors="replace").split("\x00")

    def _decode_one_by_one(self) -> list[str]:
        heads = self.heads.tolist()
        return [self.blob[a + 8 : b].decode("utf-8", errors="replace")
                for a, b in zip(heads[:-1], heads[1:])]


@dataclass(slots=True, frozen=True)
class ArrayValue:
    """A metadata array: numbers as a numpy array, strings as a StringTable."""

    item_type: int                     # a GGUFValueType number
    count: int
    values: np.ndarray | StringTable | None = None      # None: an array of arrays, skipped


def read_metadata(cur: Cursor) -> tuple[dict, int]:
    """Check magic and version, read every key/value; return (fields, tensor_count)."""
    start = cur.take(4)
    if cur.buf[start : start + 4] != b"GGUF":
        raise LayoutError("it does not start with the GGUF magic bytes")
    version = cur.u32()
    if version & 0xFFFF == 0:
        raise LayoutError("it is a big-endian GGUF file, which astream cannot read")
    if version not in (2, 3):
        raise LayoutError(f"GGUF version {version} is not supported (2 and 3 are)")
    tensor_count, kv_count = cur.u64(), cur.u64()
    fields: dict = {}
    for _ in range(kv_count):
        key = bytes(cur.string()).decode("utf-8", errors="replace")
        fields[key] = _read_value(cur, cur.u32())
    return fields, tensor_count


def _value_type(raw_type: int, cur: Cursor) -> GGUFValueType:
    try:
        return GGUFValueType(raw_type)
    except ValueError:
        raise LayoutError(f"unknown metadata value type {raw_type} at byte {cur.pos}") from None


def _read_value(cur: Cursor, raw_type: int):
    vtype = _value_type(raw_type, cur)
    if vtype == GGUFValueType.STRING:
        return bytes(cur.string()).decode("utf-8", errors="replace")
    if vtype == GGUFValueType.ARRAY:
        return _read_array(cur)
    dtype = _DTYPES[vtype]
    value = np.frombuffer(cur.buf, dtype, 1, cur.take(dtype.itemsize))[0]
    if vtype == GGUFValueType.FLOAT32:       # shortest float32 repr: 1e-05, not 9.99999974e-06
        return float(str(value))
    return value.item()


def _read_array(cur: Cursor) -> ArrayValue:
    item_type, count = cur.u32(), cur.u64()
    vtype = _value_type(item_type, cur)
    if vtype in _DTYPES:
        dtype = _DTYPES[vtype]
        start = cur.take(count * dtype.itemsize)
        return ArrayValue(item_type, count, np.frombuffer(cur.buf, dtype, count, start).copy())
    if count > (len(cur.buf) - cur.pos) // 8:   # every item takes at least 8 bytes
        raise LayoutError(f"an array at byte {cur.pos} claims {count} items, more than the file holds")
    if vtype == GGUFValueType.STRING:
        return ArrayValue(item_type, count, _read_strings(cur, count))
    for _ in range(count):
        _read_value(cur, item_type)
    return ArrayValue(item_type, count)


def _read_strings(cur: Cursor, count: int) -> StringTable:
    buf, start = cur.buf, cur.pos
    heads = np.empty(count + 1, dtype=np.int64)
    pos, unpack = start, _U64.unpack_from
    try:
        for i in range(count):
            heads[i] = pos
            pos += 8 + unpack(buf, pos)[0]
        heads[count] = pos
    except (struct.error, OverflowError):
        raise LayoutError(f"a string array at byte {start} runs past the end of the file") from None
    cur.take(pos - start)                      # checks the last item's end against the file's
    return StringTable(bytes(buf[start:pos]), heads - start)
