"""OffloadEngine: the only place where KV crosses between host and device.

Memory it owns:
- host pool: k/v per layer, [host_blocks, block_size, kv_heads, head_dim], views of one
  allocation pinned on CUDA (exactly its size; see runtime/pinned.py);
- ring: `num_slots` device buffers a layer's host KV is loaded into;
- staging: two device buffers new KV is written to before it leaves for the host;
- tails: one device block per running sequence and layer, holding its newest,
  not yet full block.

Three streams, ordered only by events, never by the host:
- H2D (loads) waits for the slot's previous reader to finish (`slot.free`) and for the
  layer's last offload (the block it reads may have just been written);
- compute waits for `slot.loaded` before reading a slot, and for the layer's last
  offload before overwriting a staging buffer or a tail it reads from;
- D2H (offloads) waits for the compute that produced the KV (`kv_written`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from astream.models.config import ModelConfig
from astream.policies.base import BlockOffload, SparsePolicy
from astream.runtime.device import DeviceRuntime
from astream.runtime.pinned import PinnedHostTensor

Run = tuple[int, int, int]          # (source first block, destination first block, blocks)


@dataclass(slots=True)
class RingSlot:
    k: torch.Tensor                 # [slot_blocks, block_size, kv_heads, head_dim]
    v: torch.Tensor
    loaded: object = None           # H2D of its current contents done
    free: object = None             # compute done with its previous contents


@dataclass(slots=True)
class OffloadEngine:
    runtime: DeviceRuntime
    policy: SparsePolicy
    host_k: list[torch.Tensor]
    host_v: list[torch.Tensor]
    slots: list[RingSlot]
    staging: list[tuple[torch.Tensor, torch.Tensor]]
    tail_k: list[torch.Tensor]      # per layer [max_seqs + 1, block_size, kv_heads, head_dim]
    tail_v: list[torch.Tensor]
    host_pool: PinnedHostTensor | None = None   # owns host_k/host_v's memory
    h2d: object = None
    d2h: object = None
    offloaded: list = field(default_factory=list)     # per layer: its latest D2H event
    staging_free: list = field(default_factory=lambda: [None, None])
    bytes_loaded: int = 0
    bytes_offloaded: int = 0

    @classmethod
    def allocate(cls, model: ModelConfig, host_blocks: int, block_size: int, num_slots: int,
                 slot_blocks: int, staging_blocks: int, max_seqs: int, dtype: torch.dtype,
                 runtime: DeviceRuntime, policy: SparsePolicy) -> "OffloadEngine":
        shape = (block_size, model.num_kv_heads, model.head_dim)
        device, pin = runtime.device, runtime.is_cuda

        def buffers(n: int, count: int, where) -> list[torch.Tensor]:
            return [torch.zeros((n, *shape), dtype=dtype, device=where) for _ in range(count)]

        layers = model.num_layers
        # Only whole, written blocks are ever read back, so the pool needs no zeroing.
        pool = PinnedHostTensor((layers, 2, host_blocks, *shape), dtype, pin)
        host_k = [pool.tensor[layer, 0] for layer in range(layers)]
        host_v = [pool.tensor[layer, 1] for layer in range(layers)]
        slots = [RingSlot(*buffers(slot_blocks, 2, device)) for _ in range(num_slots)]
        staging = [tuple(buffers(staging_blocks, 2, device)) for _ in range(2)]
        tails_k, tails_v = buffers(max_seqs + 1, layers, device), buffers(max_seqs + 1, layers, device)
        return cls(runtime, policy, host_k, host_v, slots, staging, tails_k, tails_v, pool,
                   h2d=runtime.new_stream(), d2h=runtime.new_stream(), offloaded=[None] * layers)

    @property
    def slot_blocks(self) -> int:
        return self.slots[0].k.shape[0]

    @property
    def block_bytes(self) -> int:
        k = self.host_k[0]
        return 2 * k[0].numel() * k.element_size()

    # ---- loads: host -> ring slot ----------------------------------------------------

    def load(self, slot_index: int, layer: int, runs: list[Run]) -> None:
        """Queue the copy of host blocks into a ring slot (runs: host start, slot start, count)."""
        slot, rt = self.slots[slot_index], self.runtime
        rt.wait(slot.free, self.h2d)
        rt.wait(self.offloaded[layer], self.h2d)
        with rt.on(self.h2d):
            for host_start, slot_start, count in runs:
                slot.k[slot_start:slot_start + count].copy_(
                    self.host_k[layer][host_start:host_start + count], non_blocking=True)
                slot.v[slot_start:slot_start + count].copy_(
                    self.host_v[layer][host_start:host_start + count], non_blocking=True)
                self.bytes_loaded += count * self.block_bytes
            slot.loaded = rt.record_event(self.h2d)

    def acquire(self, slot_index: int) -> RingSlot:
        """The slot, once its load has landed (the compute stream waits, the host does not)."""
        slot = self.slots[slot_index]
        self.runtime.wait(slot.loaded)
        return slot

    def release(self, slot_index: int) -> None:
        """Compute is done reading the slot: its next load may start."""
        self.slots[slot_index].free = self.runtime.record_event()

    # ---- new KV: staging and tails -------------------------------------------------------

    def staging_for(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The staging buffer for this layer's new KV, once its previous offload has left."""
        index = layer % 2
        self.runtime.wait(self.staging_free[index])
        return self.staging[index]

    def guard_tails(self, layer: int) -> None:
        """Tails of this layer may still be leaving for the host: wait before overwriting them."""
        self.runtime.wait(self.offloaded[layer])

    def store(self, dest: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
              flat_index: torch.Tensor) -> None:
        """Write new KV rows into a staging or tail buffer at flat token indices."""
        dk, dv = dest
        dk.view(-1, *dk.shape[2:]).index_copy_(0, flat_index, k)
        dv.view(-1, *dv.shape[2:]).index_copy_(0, flat_index, v)

    # ---- offloads: staging / tails -> host ---------------------------------------------

    def offload(self, layer: int, from_staging: list[Run], from_tails: list[tuple[int, int]]) -> None:
        """Queue D2H of full blocks: staging runs (staging start, host start, count) and
        tails (tail slot, host block). The policy sees each block's keys first."""
        if not from_staging and not from_tails:
            return
        rt, index = self.runtime, layer % 2
        staging_k, staging_v = self.staging[index]
        for start, host, count in from_staging:
            for i in range(count):
                self.policy.on_block_offload(BlockOffload(host + i, layer, staging_k[start + i],
                                                          staging_k.shape[1]))
        for tail, host in from_tails:
            self.policy.on_block_offload(BlockOffload(host, layer, self.tail_k[layer][tail],
                                                      staging_k.shape[1]))
        kv_written = rt.record_event()
        rt.wait(kv_written, self.d2h)
        with rt.on(self.d2h):
            for start, host, count in from_staging:
                self._to_host(layer, host, staging_k[start:start + count], staging_v[start:start + count])
            for tail, host in from_tails:
                self._to_host(layer, host, self.tail_k[layer][tail:tail + 1],
                              self.tail_v[layer][tail:tail + 1])
            done = rt.record_event(self.d2h)
        self.offloaded[layer] = done
        if from_staging:
            self.staging_free[index] = done

    def _to_host(self, layer: int, host: int, k: torch.Tensor, v: torch.Tensor) -> None:
        count = k.shape[0]
        self.host_k[layer][host:host + count].copy_(k, non_blocking=True)
        self.host_v[layer][host:host + count].copy_(v, non_blocking=True)
        self.bytes_offloaded += count * self.block_bytes

    def free_host_pool(self) -> None:
        """Give the host pool's pinned pages back (call once the device is idle)."""
        if self.host_pool is not None:
            self.host_pool.release()

    def pending_offloads(self) -> list:
        """Events of the latest offload per layer, for the offload stage to await."""
        return [e for e in self.offloaded if e is not None]
