"""Whole prefixes for sparse prefill with offload, loaded one layer ahead of compute.

A sparse prefill estimate needs every key of a chunk's prefix at once, so on the layers
where the policy replaces prefill attention each prefix comes from the host pool whole,
packed into token-major key rows ([keys, kv_heads, head_dim]) exactly as the resident path
packs them. The loads run on the H2D stream into two packed buffers: layer i+1's prefix
crosses PCIe while layer i computes, so a long prompt's prefill pays the prefix loads
only where they take longer than a layer's compute.

Host blocks are head-major and the packed rows token-major, so each piece is staged on
the device (CONTEXT_STAGE_BLOCKS blocks at a time) and transposed into place (and
dequantized, from an fp8 pool), both on the H2D stream.

Stream order (events only, never the host):
- a buffer's loads wait for the compute that last read it (`free`), and for the layer's
  latest offload, which wrote the blocks they read (earlier steps' chunks);
- compute waits for the buffer's loads (`loaded`) before writing this chunk's rows into it.
Both buffers are allocated on the compute stream and recorded on the H2D stream, so the
allocator reuses them only once their loads are done, even when a step fails midway.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from astream.kvcache.kv_format import KVFormat
from astream.runtime.device import DeviceRuntime
from astream.runtime.events import Event

CONTEXT_STAGE_BLOCKS = 64     # host blocks staged on the device at a time


@dataclass(slots=True)
class PackedKeys:
    k: torch.Tensor                      # [keys, kv_heads, head_dim]
    v: torch.Tensor
    loaded: Event | None = None          # its prefix has landed
    free: Event | None = None            # compute is done with its previous layer


@dataclass(slots=True)
class ContextLoads:
    """One step's prefixes for the layers in `layers` (compute order), from host blocks
    (`runs`) into two packed buffers."""

    runtime: DeviceRuntime
    h2d: torch.cuda.Stream | None
    host_k: list[torch.Tensor]           # per layer [blocks, kv_heads, block_size, head_dim]
    host_v: list[torch.Tensor]
    offloaded: list[Event | None]        # per layer: its latest D2H (the engine's own list)
    runs: tuple[tuple[int, int, int], ...]   # (first host block, first packed row, blocks)
    layers: list[int]
    format: KVFormat                     # the host pool's; packed rows are dequantized
    buffers: list[PackedKeys] = field(default_factory=list)
    issued: int = 0
    done: int = 0

    def allocate(self, num_keys: int) -> None:
        """Two packed buffers of `num_keys` rows (one if nothing is loaded), and the first
        two layers' loads."""
        host = self.host_k[0]
        shape = (num_keys, host.shape[1], host.shape[-1])
        count = 2 if self.runs and len(self.layers) > 1 else 1
        ready = self.runtime.record_event()     # the memory's previous users on the compute stream
        for _ in range(count):
            k = torch.empty(shape, dtype=self.format.compute_dtype, device=self.runtime.device)
            self.buffers.append(PackedKeys(k, torch.empty_like(k), free=ready))
        self._prefetch()

    def keys(self, layer: int) -> PackedKeys:
        """The packed rows of `layer`, its prefix in place once the compute stream reaches
        them; the next layer's prefix starts loading now. Call `release` after the last
        kernel that reads them is queued."""
        assert self.layers[self.done] == layer, "layers must be read in order"
        self._prefetch()
        packed = self.buffers[self.done % len(self.buffers)]
        self.runtime.wait(packed.loaded)
        return packed

    def release(self) -> None:
        self.buffers[self.done % len(self.buffers)].free = self.runtime.record_event()
        self.done += 1

    def _prefetch(self) -> None:
        while self.runs and self.issued < min(self.done + len(self.buffers), len(self.layers)):
            self._load(self.layers[self.issued], self.buffers[self.issued % len(self.buffers)])
            self.issued += 1

    def _load(self, layer: int, packed: PackedKeys) -> None:
        rt, h2d = self.runtime, self.h2d
        if h2d is not None:
            # Should compute never wait for this load (a layer raised before it), the
            # allocator must still not hand the buffer out while the copy may run.
            packed.k.record_stream(h2d)
            packed.v.record_stream(h2d)
        rt.wait(packed.free, h2d)
        rt.wait(self.offloaded[layer], h2d)
        host_k, host_v = self.host_k[layer], self.host_v[layer]
        block, stage = host_k.shape[2], CONTEXT_STAGE_BLOCKS
        pieces = [(src + first, dst + first * block, min(stage, count - first))
                  for src, dst, count in self.runs for first in range(0, count, stage)]
        with rt.on(h2d):
            largest = max(count for _, _, count in pieces)
            stage_k = torch.empty((largest, *host_k.shape[1:]), dtype=host_k.dtype, device=rt.device)
            stage_v = torch.empty_like(stage_k)
            for src, dst, count in pieces:
                # Stream order makes reusing the staging buffers safe: each copy out of them
                # is queued before the next load into them.
                stage_k[:count].copy_(host_k[src:src + count], non_blocking=True)
                stage_v[:count].copy_(host_v[src:src + count], non_blocking=True)
                rows = slice(dst, dst + count * block)
                k, v = self.format.dequantize(layer, stage_k[:count].transpose(1, 2),
                                              stage_v[:count].transpose(1, 2))
                packed.k[rows].view(count, block, *packed.k.shape[1:]).copy_(k)
                packed.v[rows].view(count, block, *packed.v.shape[1:]).copy_(v)
            packed.loaded = rt.record_event(h2d)
