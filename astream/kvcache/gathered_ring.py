"""A decode step's host KV for a CUDA graph: each layer's whole context gathered into a
ring slot by a device kernel reading the pinned pool in place, a layer ahead of compute.

The eager ring (offload_engine.RingLoads) copies with cudaMemcpyAsync, whose source
addresses a graph would freeze; here the blocks come from device tables, so the same
program serves every step. Two ring slots alternate: layer i+1's gather runs on a side
stream while layer i computes. Every row's blocks are packed into one slot
(`block_gather.packed_block_table`), so the step's host blocks must fit one slot.

Stream order, all on the device (inside a capture these become graph edges):
- the side stream starts after the compute stream's work so far (the step's inputs, the
  latest offloads the caller made it wait for);
- a slot's gather waits for the compute that read its previous layer (`free`);
- compute waits for the slot's gather (`gathered`) before reading it;
- `finish` joins the side stream back, as a capture requires.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch

from astream.kvcache.offload_engine import OffloadEngine, RingSlot
from astream.ops.block_gather import gather_blocks, packed_block_table
from astream.runtime.events import Event

GATHER_SLOTS = 2


@dataclass(slots=True)
class GatheredRing:
    engine: OffloadEngine
    tables: torch.Tensor                 # [B, M] host blocks of each row (full blocks only)
    nblocks: torch.Tensor                # [B] int32 full host blocks of each row
    dst_table: torch.Tensor              # [B, M] int32 their blocks in a slot, packed
    layers: list[int]                    # layers read from the host, in compute order
    side: torch.cuda.Stream | None
    gathered: list[Event | None] = field(default_factory=lambda: [None] * GATHER_SLOTS)
    free: list[Event | None] = field(default_factory=lambda: [None] * GATHER_SLOTS)
    issued: int = 0
    done: int = 0

    @classmethod
    def started(cls, engine: OffloadEngine, tables: torch.Tensor, nblocks: torch.Tensor,
                layers: list[int], side: torch.cuda.Stream | None) -> GatheredRing:
        """A captured step's ring over `engine`'s host pool: each of `layers` gathered whole
        (rows' first nblocks blocks of tables), started, with its first loads queued."""
        ring = cls(engine, tables, nblocks, packed_block_table(nblocks, tables.shape[1]),
                   layers, side)
        ring.start()
        return ring

    def start(self) -> None:
        """Fork the side stream from the compute stream and gather the first layers."""
        self.engine.runtime.wait(self.engine.runtime.record_event(), self.side)
        self._prefetch()

    def layer(self, layer: int) -> Iterator[tuple[int, RingSlot]]:
        """(0, slot) once the layer's context has landed in it (the compute stream waits, not
        the host); leaving the loop body frees the slot for the layer two ahead."""
        rt = self.engine.runtime
        assert self.layers[self.done] == layer, "layers must be read in order"
        index = self.done % GATHER_SLOTS
        rt.wait(self.gathered[index])
        yield 0, self.engine.slots[index]
        self.free[index] = rt.record_event()
        self.done += 1
        self._prefetch()

    def finish(self) -> None:
        """Join the side stream into the compute stream (a capture must end joined)."""
        if self.side is not None:
            torch.cuda.current_stream(self.engine.runtime.device).wait_stream(self.side)

    def _prefetch(self) -> None:
        rt, engine = self.engine.runtime, self.engine
        while self.issued < min(self.done + GATHER_SLOTS, len(self.layers)):
            layer, index = self.layers[self.issued], self.issued % GATHER_SLOTS
            slot = engine.slots[index]
            rt.wait(self.free[index], self.side)
            with rt.on(self.side):
                gather_blocks(engine.host_k[layer], engine.host_v[layer], self.tables,
                              self.nblocks, self.dst_table, slot.k, slot.v)
                self.gathered[index] = rt.record_event(self.side)
            self.issued += 1
