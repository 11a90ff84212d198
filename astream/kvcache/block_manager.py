"""Paged KV block accounting with prefix caching. Pure Python: no tensors here.

A full block is identified by a hash chained over every token before it, so two
sequences share a block only when their whole prefixes agree. Freed blocks keep
their hash and stay reusable until the allocator needs them for something else
(least recently freed first).

Blocks come into being when first handed out (ids ascending from 0): a cache of hundreds
of thousands of blocks costs nothing until it is used, not a second of engine start-up.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterator, Protocol


class BlockOwner(Protocol):
    """What the block manager reads and writes of a sequence: its table of blocks, how many
    tokens are computed and how many leading blocks are published, and its token ids."""

    block_table: list[int]             # only appended to; release starts a new list (the
                                       # executor copies unchanged tables from step to step)
    num_computed_tokens: int
    num_hashed_blocks: int
    num_pending: int                   # sampled tokens whose ids the host has not seen yet
    kv_epoch: int                      # names this life of block_table: set anew, unique,
                                       # whenever an empty table gets its first block

    @property
    def num_tokens(self) -> int: ...

    def token_slice(self, start: int, end: int) -> list[int]: ...


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()     # kept to rule out hash collisions


@dataclass(slots=True)
class BlockManager:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    blocks: list[Block] = field(default_factory=list)      # every block handed out so far
    free: OrderedDict = field(default_factory=OrderedDict)  # block_id -> None, of those: the
                                                            # unhashed first, then least recently freed
    cached: dict[int, int] = field(default_factory=dict)    # hash -> block_id
    prefix_hits: int = 0                             # blocks reused from the cache, for stats
    epochs: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    @property
    def num_free(self) -> int:
        return len(self.free) + self.num_blocks - len(self.blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ---------------------------------------------------------------

    def reuse_cached_prefix(self, seq: BlockOwner) -> int:
        """Attach the longest run of cached full blocks to a new sequence; return its tokens.

        At least one token is always left to compute, so the last logits exist.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        seq.kv_epoch = next(self.epochs)
        if not self.enable_prefix_caching:
            return 0
        prev_hash, hits = None, 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for index in range(max_blocks):
            tokens = tuple(seq.token_slice(index * self.block_size, (index + 1) * self.block_size))
            prev_hash = _chain(prev_hash, tokens)
            block_id = self.cached.get(prev_hash)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            self._take(block_id)
            seq.block_table.append(block_id)
            hits += 1
        self.prefix_hits += hits
        seq.num_hashed_blocks = hits
        seq.num_computed_tokens = hits * self.block_size
        return seq.num_computed_tokens

    def register_full_blocks(self, seq: BlockOwner, num_written: int) -> None:
        """Publish the full blocks among seq's first num_written tokens (KV on the device).

        Only blocks whose KV a finished step wrote may be published: a block that is
        merely scheduled could be abandoned (abort) before it is ever computed.
        """
        start = seq.num_hashed_blocks
        if not self.enable_prefix_caching or num_written < (start + 1) * self.block_size:
            return                                          # no block newly full: most steps
        known = seq.num_tokens - seq.num_pending
        full = min(num_written, known, len(seq.block_table) * self.block_size) // self.block_size
        prev_hash = self.blocks[seq.block_table[start - 1]].hash if start else None
        for index in range(start, full):
            block = self.blocks[seq.block_table[index]]
            if block.hash is None:
                tokens = tuple(seq.token_slice(index * self.block_size, (index + 1) * self.block_size))
                block.hash, block.token_ids = _chain(prev_hash, tokens), tokens
                self.cached.setdefault(block.hash, block.block_id)
            prev_hash = block.hash
        seq.num_hashed_blocks = max(start, full)

    # ---- allocation -----------------------------------------------------------------

    def can_grow(self, seq: BlockOwner, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(seq.block_table) <= self.num_free

    def grow(self, seq: BlockOwner, num_tokens: int) -> None:
        """Give seq enough blocks to hold num_tokens tokens."""
        need = self.blocks_needed(num_tokens) - len(seq.block_table)
        if need > self.num_free:
            raise RuntimeError(f"out of KV blocks: need {need}, {self.num_free} free")
        if need > 0 and not seq.block_table:
            seq.kv_epoch = next(self.epochs)
        for _ in range(max(need, 0)):
            block_id = self._pick(seq.block_table[-1] + 1 if seq.block_table else None)
            self._evict(block_id)
            self._take(block_id)
            seq.block_table.append(block_id)

    def _pick(self, wanted: int | None) -> int:
        # Consecutive ids make one copy of many blocks when KV moves between host and
        # device. Otherwise: a freed block with nothing to keep, else a never-used one,
        # else the least recently freed (its prefix is the least likely to come back).
        fresh = len(self.blocks)
        if wanted is not None and (wanted in self.free or wanted == fresh < self.num_blocks):
            block_id = wanted
        else:
            first = next(iter(self.free), None)
            usable = first is not None and self.blocks[first].hash is None
            block_id = first if usable or fresh == self.num_blocks else fresh
        if block_id == fresh:
            self.blocks.append(Block(fresh))
        return block_id

    def release(self, seq: BlockOwner) -> None:
        """Drop seq's references; blocks nobody holds return to the free list.

        In table order, so a later sequence taking them gets them in ascending runs."""
        unhashed = []
        for block_id in seq.block_table:
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} released twice"
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.hash is None:
                    unhashed.append(block_id)
        for block_id in reversed(unhashed):                 # nothing to keep: reuse these first
            self.free.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_hashed_blocks = 0
        seq.num_computed_tokens = 0

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.free.pop(block_id, None)                   # absent: never used before
        block.ref_count += 1

    def _evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]
        block.hash, block.token_ids = None, ()


def _chain(prev_hash: int | None, tokens: tuple[int, ...]) -> int:
    return hash((prev_hash, tokens))
