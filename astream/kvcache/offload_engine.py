"""OffloadEngine: the only place where KV crosses between host and device.

Memory it owns, every buffer head-major ([blocks, kv_heads, block_size, head_dim]) so that
one KV head's run of tokens in a block is contiguous (a sparse policy's page gather reads
it in one piece) and every copy between host and device is a plain block range:
- host pool: k/v per layer, views of one allocation pinned on CUDA (exactly its size;
  see runtime/pinned.py);
- ring: `num_slots` device buffers a layer's host KV is loaded into;
- staging: two device buffers new KV is written to before it leaves for the host;
- tails: one device block per running sequence and layer, holding its newest,
  not yet full block, and one scratch block (padded rows of a captured step write it);
- on_device: for the layers a sparse policy never makes sparse (`device_layers`, e.g.
  Quest's dense layers), a device copy of their whole cache, paged by the host pool's
  block ids. Those layers are read and written there only: their KV never crosses PCIe
  (the resident path's attention runs on it, through `on_device`);
- device keys: for the layers a policy asks (`key_layers`, Quest's `keys_on_device`), a
  device copy of the host pool's keys, block for block, written as the keys leave for the
  host: `gather_pages` reads their keys there and only their values over PCIe.

Its whole API: `write_layer` (a layer's new KV in, and on its way to the host; after a
captured decode step, `send_tails` and `wait_offloads` do its ordering from outside),
`tails` (the device tails a layer's decode attends to), `loads` (one step's loads into
the ring, iterated layer by layer: each slot is acquired when its copy lands, released
when the caller is done with it, and the next load starts; `load_slot` is one such load,
for rings driven from outside), `gather_pages` (chosen
pages of a layer's host KV, read in place by the device, into new buffers or into given
pages of a caller's), `context_loads` (whole prefixes, for a sparse prefill policy, a layer ahead),
`pending_offloads`, and `free_host_pool`. Views handed out are token-major ([blocks, block_size, kv_heads,
head_dim], strided), the layout the attention kernels take.

Five streams, ordered only by events, never by the host:
- H2D (loads) waits for the slot's previous reader to finish (`slot.free`) and for the
  layer's last offload (the block it reads may have just been written);
- compute waits for `slot.loaded` before reading a slot, and for the layer's last
  offload before overwriting a staging buffer or a tail it reads from;
- D2H (offloads) waits for the compute that produced the KV;
- prefetch predicts and selects a layer ahead of compute (a policy's `prefetch_pages`): it
  waits for the compute queued before it, and compute waits for it before the layer it
  selected for (executor.offload_attention);
- prefetch_load runs that selection's `gather_pages(background=True)`: it waits for the
  selection, and compute waits for it too. Apart from prefetch, the next layer's selection
  need not queue behind this layer's load. Both have the higher priority, so page reads
  start while the layer before computes rather than after.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, NamedTuple

import torch

from astream.kvcache.context_loads import ContextLoads
from astream.kvcache.kv_format import KVFormat, KVScales
from astream.kvcache.paged_cache import PagedKVCache
from astream.models.config import ModelConfig
from astream.ops.kv_write import store_head_major
from astream.ops.pages import gather_pages
from astream.runtime.device import DeviceRuntime
from astream.runtime.events import Event
from astream.runtime.pinned import PinnedHostTensor

class Run(NamedTuple):
    """A copy of `count` consecutive blocks, from block `src` of one buffer to block `dst`
    of another (host pool, ring slot, staging buffer or tails, by context)."""

    src: int
    dst: int
    count: int


@dataclass(slots=True, frozen=True)
class NewKV:
    """Where one step's new K/V rows go; the same for every layer."""

    staging_rows: torch.Tensor | None    # rows that fill whole blocks: staged, then sent to host
    staging_index: torch.Tensor | None   # their flat token positions in the staging buffer
    tail_rows: torch.Tensor | None       # rows that go to their sequence's device tail
    tail_index: torch.Tensor | None      # their flat token positions in the tails
    staging_to_host: tuple[Run, ...]     # staging block -> host block
    tails_to_host: tuple[Run, ...]       # tails that filled up: tail -> host block (count 1)


@dataclass(slots=True)
class RingSlot:
    k: torch.Tensor                      # [slot_blocks, kv_heads, block_size, head_dim]
    v: torch.Tensor
    loaded: Event | None = None          # H2D of its current contents done
    free: Event | None = None            # compute done with its previous contents

    @property
    def k_tokens(self) -> torch.Tensor:
        """[slot_blocks, block_size, kv_heads, head_dim] view."""
        return self.k.transpose(1, 2)

    @property
    def v_tokens(self) -> torch.Tensor:
        return self.v.transpose(1, 2)


@dataclass(slots=True)
class OffloadEngine:
    runtime: DeviceRuntime
    host_k: list[torch.Tensor]
    host_v: list[torch.Tensor]
    slots: list[RingSlot]
    staging: list[tuple[torch.Tensor, torch.Tensor]]
    tail_k: list[torch.Tensor]           # per layer [max_seqs + 1, kv_heads, block_size, head_dim]
    tail_v: list[torch.Tensor]
    format: KVFormat                     # every buffer holds format.dtype (maybe fp8)
    host_pool: PinnedHostTensor | None = None   # owns host_k/host_v's memory
    on_device: PagedKVCache | None = None       # device copy of the layers that read everything
    device_layers: frozenset[int] = frozenset()
    device_k: list[torch.Tensor | None] = field(default_factory=list)   # per layer: keys kept here
    h2d: torch.cuda.Stream | None = None
    d2h: torch.cuda.Stream | None = None
    prefetch: torch.cuda.Stream | None = None
    # A prefetch's loads, apart from its selection: the next layer's selection need not queue
    # behind this layer's load, so the link stays busy.
    prefetch_load: torch.cuda.Stream | None = None
    prefetch_loaded: Event | None = None       # the latest load queued on prefetch_load, if unread
    offloaded: list[Event | None] = field(default_factory=list)   # per layer: its latest D2H
    staging_free: list[Event | None] = field(default_factory=lambda: [None, None])
    bytes_loaded: int = 0
    bytes_offloaded: int = 0

    @classmethod
    def allocate(cls, model: ModelConfig, host_blocks: int, block_size: int, num_slots: int,
                 slot_blocks: int, staging_blocks: int, max_seqs: int, fmt: KVFormat,
                 runtime: DeviceRuntime, device_layers: tuple[int, ...] = (),
                 key_layers: tuple[int, ...] = ()) -> "OffloadEngine":
        shape = (model.num_kv_heads, block_size, model.head_dim)
        device, pin, dtype = runtime.device, runtime.is_cuda, fmt.dtype

        def buffers(n: int, count: int) -> list[torch.Tensor]:
            return [torch.zeros((n, *shape), dtype=dtype, device=device) for _ in range(count)]

        layers = model.num_layers
        # Only whole, written blocks are ever read back, so the pool needs no zeroing.
        pool = PinnedHostTensor((layers, 2, host_blocks, *shape), dtype, pin)
        host_k = [pool.tensor[layer, 0] for layer in range(layers)]
        host_v = [pool.tensor[layer, 1] for layer in range(layers)]
        slots = [RingSlot(*buffers(slot_blocks, 2)) for _ in range(num_slots)]
        staging = [tuple(buffers(staging_blocks, 2)) for _ in range(2)]
        on_device = PagedKVCache.allocate_layers(model, device_layers, host_blocks, block_size,
                                                 fmt, device) if device_layers else None
        # Like the pool, read only where written: no zeroing.
        device_k = [torch.empty((host_blocks, *shape), dtype=dtype, device=device)
                    if layer in key_layers else None for layer in range(layers)]
        return cls(runtime, host_k, host_v, slots, staging, buffers(max_seqs + 1, layers),
                   buffers(max_seqs + 1, layers), fmt, pool, on_device, frozenset(device_layers),
                   device_k, h2d=runtime.new_stream(), d2h=runtime.new_stream(),
                   prefetch=runtime.new_stream(priority=-1),
                   prefetch_load=runtime.new_stream(priority=-1), offloaded=[None] * layers)

    @property
    def slot_blocks(self) -> int:
        return self.slots[0].k.shape[0]

    @property
    def block_size(self) -> int:
        return self.slots[0].k.shape[2]

    @property
    def scratch_tail(self) -> int:
        return self.tail_k[0].shape[0] - 1

    @property
    def block_bytes(self) -> int:
        k = self.host_k[0]
        return 2 * k[0].numel() * k.element_size()

    # ---- new KV: staging and tails, then to the host -----------------------------------------

    def write_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, new: NewKV) -> torch.Tensor:
        """Store a layer's new K/V rows ([T, kv_heads, head_dim], quantized here) and start
        copying the blocks they complete to the host, overlapping the rest of this layer and
        the next. Returns the keys as stored (format.dtype)."""
        rt = self.runtime
        k, v = self.format.quantize(layer, k, v)
        rt.wait(self.offloaded[layer])          # its tails may still be leaving for the host
        staging = self.staging[layer % 2]
        if new.staging_rows is not None:
            rt.wait(self.staging_free[layer % 2])
            store_head_major(*staging, new.staging_index, k, v, new.staging_rows)
        if new.tail_rows is not None:
            store_head_major(self.tail_k[layer], self.tail_v[layer], new.tail_index, k, v,
                             new.tail_rows)
        if new.staging_to_host or new.tails_to_host:
            done = self._to_host([layer], staging, new)
            if new.staging_to_host:
                self.staging_free[layer % 2] = done
        return k

    def scales(self, layer: int) -> KVScales | None:
        """The layer's dequantization scales, for kernels reading its tails, slots or pages."""
        return self.format.scales(layer)

    def tails(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's device tail blocks, [max_seqs + 1, block_size, kv_heads, head_dim] views."""
        return self.tail_k[layer].transpose(1, 2), self.tail_v[layer].transpose(1, 2)

    def send_tails(self, layers: list[int], runs: tuple[Run, ...]) -> None:
        """After a captured decode step (a CUDA graph holds no D2H copies): the tails it filled
        (`runs`, tail -> host block), in every layer of `layers`, on their way to the host."""
        if runs:
            self._to_host(layers, None, NewKV(None, None, None, None, (), runs))

    def wait_offloads(self) -> None:
        """The compute stream waits for every layer's latest offload, as `write_layer` and
        `gather_pages` do one layer at a time (a captured step cannot wait inside)."""
        for event in self.pending_offloads():
            self.runtime.wait(event)

    def _to_host(self, layers: list[int], staging: tuple[torch.Tensor, torch.Tensor] | None,
                 new: NewKV) -> Event:
        rt = self.runtime
        rt.wait(rt.record_event(), self.d2h)    # the compute that wrote the KV comes first
        with rt.on(self.d2h):
            for layer in layers:
                for run in new.staging_to_host:
                    self._copy_to_host(layer, run, *staging)
                for run in new.tails_to_host:
                    self._copy_to_host(layer, run, self.tail_k[layer], self.tail_v[layer])
            done = rt.record_event(self.d2h)
        for layer in layers:
            self.offloaded[layer] = done
        return done

    def _copy_to_host(self, layer: int, run: Run, k: torch.Tensor, v: torch.Tensor) -> None:
        src, dst, count = run
        self.host_k[layer][dst:dst + count].copy_(k[src:src + count], non_blocking=True)
        self.host_v[layer][dst:dst + count].copy_(v[src:src + count], non_blocking=True)
        device_k = self.device_keys(layer)
        if device_k is not None:                # on the same stream, under the same event
            device_k[dst:dst + count].copy_(k[src:src + count], non_blocking=True)
        self.bytes_offloaded += count * self.block_bytes

    # ---- loads: host -> ring slots --------------------------------------------------------------

    def loads(self, layer_jobs: list[list[list[Run]]]) -> "RingLoads":
        """One step's loads: for each layer its jobs (host block -> slot block runs, one ring
        slot's worth each). Loads start at once and run `num_slots` jobs ahead of compute."""
        ring = RingLoads(self, layer_jobs, [(layer, runs) for layer, jobs in enumerate(layer_jobs)
                                            for runs in jobs])
        ring.prefetch()
        return ring

    def gather_pages(self, layer: int, page_ids: torch.Tensor, counts: torch.Tensor, page_size: int,
                     into: tuple[torch.Tensor, torch.Tensor] | None = None,
                     dst_pages: torch.Tensor | None = None,
                     background: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Pages of the layer's host KV (page_ids [B, KVH, P] physical page ids, the first
        counts [B, KVH] of each row real) read in place by a device kernel, on the current
        stream (compute; prefetch_load where `background`), into dense k, v [B, KVH, P * page_size, head_dim]: new
        buffers, or `into` (of any number of pages), where with dst_pages [B, KVH, P] entry p
        fills page dst_pages[b, h, p] (-1: not read). Where the device keeps the layer's keys,
        they are read there, and only the values cross PCIe. A `background` gather (a
        prefetch, beside a layer's compute) keeps to a few SMs (ops.pages.gather_pages) and
        runs on `prefetch_load`, after what the current stream queued; `prefetch_loaded`
        then marks it."""
        rt = self.runtime
        if into is None:
            batch, kv_heads, pages = page_ids.shape
            shape = (batch, kv_heads, pages * page_size, self.host_k[layer].shape[-1])
            into = (torch.empty(shape, dtype=self.host_k[layer].dtype, device=rt.device),
                    torch.empty(shape, dtype=self.host_k[layer].dtype, device=rt.device))
        stream = self.prefetch_load if background else None
        if stream is not None:
            rt.wait(rt.record_event(), stream)  # after the selection that named the pages
            for tensor in (page_ids, counts, dst_pages, *into):
                if tensor is not None:          # made on the selecting stream, used here
                    tensor.record_stream(stream)
        keys = self.device_keys(layer)
        with rt.on(stream):
            rt.wait(self.offloaded[layer])      # no page is read while it is being written
            gather_pages(self.host_k[layer] if keys is None else keys, self.host_v[layer],
                         page_ids, *into, counts, dst_pages, page_size, background=background)
        if stream is not None:
            self.prefetch_loaded = rt.record_event(stream)
        return into

    def device_keys(self, layer: int) -> torch.Tensor | None:
        """The device's copy of the layer's keys (`key_layers`), or None."""
        return self.device_k[layer] if self.device_k else None

    def context_loads(self, runs: tuple[Run, ...], layers: list[int], num_keys: int) -> ContextLoads:
        """One step's whole prefixes (host block runs -> packed key rows) for `layers`, in
        compute order, loaded on the H2D stream a layer ahead (kvcache.context_loads)."""
        loads = ContextLoads(self.runtime, self.h2d, self.host_k, self.host_v, self.offloaded,
                             runs, layers, self.format)
        loads.allocate(num_keys)
        self.bytes_loaded += len(layers) * sum(run.count for run in runs) * self.block_bytes
        return loads

    def load_slot(self, slot: RingSlot, layer: int, runs: list[Run]) -> None:
        """Copy `runs` of the layer's host blocks into `slot` on the H2D stream, after the
        slot's previous reader and the layer's latest offload; sets `slot.loaded`."""
        rt = self.runtime
        rt.wait(slot.free, self.h2d)
        rt.wait(self.offloaded[layer], self.h2d)
        with rt.on(self.h2d):
            for src, dst, count in runs:
                slot.k[dst:dst + count].copy_(self.host_k[layer][src:src + count], non_blocking=True)
                slot.v[dst:dst + count].copy_(self.host_v[layer][src:src + count], non_blocking=True)
                self.bytes_loaded += count * self.block_bytes
            slot.loaded = rt.record_event(self.h2d)

    # ---- lifetime ------------------------------------------------------------------------------

    def pending_offloads(self) -> list[Event]:
        """Events of the latest offload per layer, for the engine to await before reuse."""
        return [e for e in self.offloaded if e is not None]

    def settle(self) -> None:
        """Wait, on the host, for every offload in flight and forget its event (start-up and
        CUDA-graph capture only: a capture may not wait on work recorded outside it)."""
        self.runtime.synchronize()
        self.offloaded = [None] * len(self.offloaded)
        self.staging_free = [None, None]
        self.prefetch_loaded = None

    def free_host_pool(self) -> None:
        """Give the host pool's pinned pages back (call once the device is idle)."""
        if self.host_pool is not None:
            self.host_pool.release()


@dataclass(slots=True)
class RingLoads:
    """Every layer's load jobs in compute order, kept `num_slots` jobs ahead of compute."""

    engine: OffloadEngine
    layer_jobs: list[list[list[Run]]]
    order: list[tuple[int, list[Run]]]         # (layer, runs) of every job, in compute order
    issued: int = 0
    done: int = 0

    def layer(self, layer: int) -> Iterator[tuple[int, RingSlot]]:
        """(job index, slot) for each job of `layer`, once its load has landed (the compute
        stream waits, not the host). Leaving the loop body releases the slot."""
        engine, num_slots = self.engine, len(self.engine.slots)
        for job in range(len(self.layer_jobs[layer])):
            assert self.order[self.done][0] == layer, "layers must be iterated in order"
            slot = engine.slots[self.done % num_slots]
            engine.runtime.wait(slot.loaded)
            yield job, slot
            slot.free = engine.runtime.record_event()
            self.done += 1
            self.prefetch()

    def prefetch(self) -> None:
        engine, num_slots = self.engine, len(self.engine.slots)
        while self.issued < min(self.done + num_slots, len(self.order)):
            layer, runs = self.order[self.issued]
            engine.load_slot(engine.slots[self.issued % num_slots], layer, runs)
            self.issued += 1
