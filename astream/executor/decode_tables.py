"""The decode rows' block tables as one padded host array, copied from the previous step's
where a table has not changed.

Turning every table's Python ints into an array each step costs time in proportion to
the whole context of the batch, although a step changes few tables: a decode gains a
block once every `block_size` tokens. A block table only grows by appending, and each
life of one (from its first block until its blocks are given back) has a `kv_epoch` of
its own (kvcache.block_manager), so a table with the same epoch and the same length as
last step holds the same blocks. What is kept between steps is last step's array and its
rows by epoch: numbers, never a sequence or its list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain, repeat
from operator import attrgetter
from typing import Protocol

import numpy as np

_tables, _epochs = attrgetter("block_table"), attrgetter("kv_epoch")


class TableOwner(Protocol):
    block_table: list[int]
    kv_epoch: int


@dataclass(slots=True)
class DecodeTables:
    rows: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int32))
    lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    row_of: dict[int, int] = field(default_factory=dict)      # kv_epoch -> its row in `rows`

    def build(self, owners: list[TableOwner]) -> np.ndarray:
        """[len(owners), longest] int32: each block table padded with block 0 (a new array)."""
        n = len(owners)
        tables, epochs = list(map(_tables, owners)), list(map(_epochs, owners))
        lengths = np.fromiter(map(len, tables), np.int64, n)
        out = np.zeros((n, int(lengths.max()) if n else 0), dtype=np.int32)
        src = np.fromiter(map(self.row_of.get, epochs, repeat(-1, n)), np.int64, n)
        same = src >= 0
        same[same] = self.lengths[src[same]] == lengths[same]
        width = min(out.shape[1], self.rows.shape[1])
        out[same, :width] = self.rows[src[same], :width]
        changed = np.flatnonzero(~same)
        if len(changed):
            out[changed] = _padded([tables[row] for row in changed], lengths[changed], out.shape[1])
        self.rows, self.lengths = out, lengths
        self.row_of = dict(zip(epochs, range(n)))
        return out


def _padded(tables: list[list[int]], lengths: np.ndarray, width: int) -> np.ndarray:
    out = np.zeros((len(tables), width), dtype=np.int32)
    out[np.arange(width) < lengths[:, None]] = np.fromiter(
        chain.from_iterable(tables), np.int32, int(lengths.sum()))
    return out
