"""A decode step's host KV for a chain of CUDA graphs (executor.graph_chain): each
offloaded layer's whole context copied into a ring slot by the copy engine, the host
issuing the copies between the chain's graphs.

A single graph cannot hold these copies (a captured cudaMemcpyAsync bakes in its host
addresses, and the blocks a step reads change). A kernel reading the pool in place could
live in one graph, but it moved 46-49 GB/s where the copy engine moves 54, and the chain
was faster at every context measured (docs/benchmarks-history.md, "Offloaded Full decode
from a chain of CUDA graphs"). So the step's compute is cut before each layer reads its
slot, and at each cut the host:
1. marks the slot of the layer before free (the compute queued so far has read it),
2. starts the copies the freed slots allow, up to one slot per ring slot ahead,
3. makes the compute stream wait for this layer's slot to land.
None of it waits on the host. Every row's blocks are packed into one slot in row order,
as `offload_plan` packs a ring job and `packed_block_table` describes it to the graphs, so
the step's host blocks must fit one slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from astream.kvcache.offload_engine import OffloadEngine, RingSlot, Run

# While a step is captured: ends the open graph, runs the host part, opens the next
# (executor.graph_chain.ChainCapture.cut).
Cut = Callable[[Callable[[], RingSlot]], RingSlot]


def packed_block_table(nblocks: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] int32: where row r's block j sits in the slot, after the earlier rows'
    blocks (sum(nblocks[:r]) + j), computed on the device from the rows' block counts."""
    first = torch.cumsum(nblocks, 0, dtype=torch.int32) - nblocks.to(torch.int32)
    return first.unsqueeze(1) + torch.arange(width, dtype=torch.int32, device=nblocks.device)


@dataclass(slots=True)
class CopyRing:
    engine: OffloadEngine
    layers: list[int]                    # layers read from the host, in compute order
    runs: list[Run]                      # host block -> slot block, the same for every layer
    cut: Cut | None = None               # set while the step's program is being captured
    issued: int = 0
    done: int = 0

    def layer(self, layer: int) -> Iterator[tuple[int, RingSlot]]:
        """(0, slot) once the layer's context has landed in it (the compute stream waits, not
        the host); a capture is cut here, so every replay runs `advance` at this point."""
        assert self.layers[self.done] == layer, "layers must be read in order"
        slot = self.cut(self.advance) if self.cut is not None else self.advance()
        yield 0, slot

    def advance(self) -> RingSlot:
        """The host's part before the next layer reads its slot (steps 1-3 above)."""
        rt, slots = self.engine.runtime, self.engine.slots
        self._free_last_read()
        while self.issued < min(self.done + len(slots), len(self.layers)):
            self.engine.load_slot(slots[self.issued % len(slots)], self.layers[self.issued], self.runs)
            self.issued += 1
        slot = slots[self.done % len(slots)]
        rt.wait(slot.loaded)
        self.done += 1
        return slot

    def finish(self) -> None:
        """After the step's last read (outside any capture): its slot is free."""
        if self.cut is None:
            self._free_last_read()

    def _free_last_read(self) -> None:
        """The slot the latest layer read is free once the compute queued so far is done."""
        if self.done:
            slots = self.engine.slots
            slots[(self.done - 1) % len(slots)].free = self.engine.runtime.record_event()
