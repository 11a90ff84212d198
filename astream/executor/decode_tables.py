"""The decode rows' block tables as one padded host array, copied from the previous step's
where a table has not changed.

Turning every table's Python ints into an array each step costs time in proportion to
the whole context of the batch, although a step changes few tables: a decode gains a
block once every `block_size` tokens. A block table only grows by appending to the same
list, and a sequence that gives its blocks back starts a new list (kvcache.block_manager),
so a table that is the same list object with the same length as last step holds the
same blocks. The previous step's lists stay referenced here, so no other list can take
one of their ids meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np


@dataclass(slots=True)
class DecodeTables:
    rows: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int32))
    lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    tables: list[list[int]] = field(default_factory=list)     # the lists behind `rows`
    row_of: dict[int, int] = field(default_factory=dict)      # id(list) -> its row in `rows`

    def build(self, tables: list[list[int]]) -> np.ndarray:
        """[len(tables), longest] int32: each table padded with block 0 (a new array)."""
        n = len(tables)
        lengths = np.fromiter(map(len, tables), np.int64, n)
        out = np.zeros((n, int(lengths.max()) if n else 0), dtype=np.int32)
        row_of = self.row_of
        src = np.fromiter((row_of.get(id(table), -1) for table in tables), np.int64, n)
        same = src >= 0
        same[same] = self.lengths[src[same]] == lengths[same]
        width = min(out.shape[1], self.rows.shape[1])
        out[same, :width] = self.rows[src[same], :width]
        changed = np.flatnonzero(~same)
        if len(changed):
            out[changed] = _padded([tables[row] for row in changed], lengths[changed], out.shape[1])
        self.rows, self.lengths, self.tables = out, lengths, tables
        self.row_of = {id(table): row for row, table in enumerate(tables)}
        return out


def _padded(tables: list[list[int]], lengths: np.ndarray, width: int) -> np.ndarray:
    out = np.zeros((len(tables), width), dtype=np.int32)
    out[np.arange(width) < lengths[:, None]] = np.fromiter(
        chain.from_iterable(tables), np.int32, int(lengths.sum()))
    return out
