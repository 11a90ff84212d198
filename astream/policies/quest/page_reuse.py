"""Quest's selected KV pages kept on the device from one decode step to the next, so that an
offloaded step loads over PCIe only the pages its rows did not select the step before.

A real model's choice moves slowly: on Qwen2.5-Coder-0.5B with natural text, 61-75% of a
step's pages had been chosen by the step before too (benchmarks/quest_locality.py). Per
offloaded sparse layer, each decode row keeps one buffer of C pages per KV head (C: the
selection's width, or more where a prefetch loads a wider prediction into it) and the
physical page id each slot holds. A step's plan reads nothing
on the host, so it runs inside the decode graph:

- a row's slots count only while it holds the same life of the same sequence's block
  table (`owners`, the sequences' `kv_epoch`): full blocks are never rewritten within one
  life, so a held page still has the host's bytes; any other row starts empty;
- a wanted page already in a slot is a hit: attention reads it where it is;
- each missed page takes, in order, a slot holding no wanted page, and is loaded from the
  host pool into it (`HostPages.gather_pages` with destination pages).

`plan_reuse` is the torch reference; `plan_reuse_` carries a plan out in place, on CUDA in
one Triton kernel a layer (astream.ops.triton_page_reuse).

Rows are decode rows in step order, so a sequence keeps its slots while the batch keeps
its order; a row whose sequence changed starts empty, which costs loads, never a wrong page.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import Tensor

from astream.ops.quest import select_quest_backend

log = logging.getLogger("astream")

EARLY, LATE = 0, 1      # the columns of PageReuse.loaded: loaded by a prefetch, by the layer itself


@dataclass(slots=True)
class ReusePlan:
    page_list: Tensor      # [R, KVH, P] int32: the slot each wanted page is read from
    load_to: Tensor        # [R, KVH, P] int64: the slot a missed page loads into; -1: no load
    held: Tensor           # [R, KVH, C] int64: the page each slot holds after the loads
    loads: Tensor          # [] int64: pages to load


def plan_reuse(held: Tensor, owner: Tensor, want: Tensor, counts: Tensor,
               owners: Tensor) -> ReusePlan:
    """Where each wanted page is read from, and which pages must load (see the module doc).

    held [R, KVH, C] int64 page ids (-1: empty slot); owner [R, KVH] int64 the epoch the
    slots were filled under; want [R, KVH, P] int64 page ids, the first counts [R, KVH] of
    each row real and distinct, P <= C; owners [R] int64 each row's epoch this step."""
    width, slots = want.shape[-1], held.shape[-1]
    held = torch.where((owner != owners.unsqueeze(-1)).unsqueeze(-1), -1, held)
    wanted = torch.arange(width, device=want.device) < counts.unsqueeze(-1)
    # [R, KVH, P, C]: wanted page p sits in slot c
    found = (want.unsqueeze(-1) == held.unsqueeze(-2)) & wanted.unsqueeze(-1) & (held >= 0).unsqueeze(-2)
    hit = found.any(-1)
    free = ~found.any(-2)                                   # [R, KVH, C]: no wanted page there
    miss = wanted & ~hit
    # The k-th miss takes the k-th free slot (there are at least as many free slots as misses).
    takes = (((miss.cumsum(-1) - 1).unsqueeze(-1) == (free.cumsum(-1) - 1).unsqueeze(-2))
             & free.unsqueeze(-2) & miss.unsqueeze(-1))
    slot = torch.where(hit, found.to(torch.uint8).argmax(-1), takes.to(torch.uint8).argmax(-1))
    load_to = torch.where(miss, slot, -1)
    # Misses land in their slots; everything else writes the extra column, then dropped.
    spill = torch.cat((held, held.new_full((*held.shape[:-1], 1), -1)), dim=-1)
    spill.scatter_(-1, torch.where(miss, slot, slots), want.long())
    return ReusePlan(torch.where(wanted, slot, 0).to(torch.int32), load_to, spill[..., :slots],
                     miss.sum())


def plan_reuse_(held: Tensor, owner: Tensor, want: Tensor, counts: Tensor, owners: Tensor,
                loaded: Tensor) -> tuple[Tensor, Tensor]:
    """`plan_reuse` carried out: held and owner take the plan's state in place, loaded [1]
    int64 gains its loads; returns (page_list, load_to). One Triton kernel on CUDA."""
    if select_quest_backend(want.device) == "triton":
        from astream.ops.triton_page_reuse import plan_reuse_triton
        return plan_reuse_triton(held, owner, want, counts, owners, loaded)
    plan = plan_reuse(held, owner, want, counts, owners)
    held.copy_(plan.held)
    owner.copy_(owners.unsqueeze(-1).expand_as(owner))
    loaded += plan.loads
    return plan.page_list, plan.load_to


@dataclass(slots=True)
class PageReuse:
    """Per offloaded sparse layer, the decode rows' page buffers and what their slots hold;
    allocated at a layer's first use (before any graph is captured: the capture's warm-up
    runs first), for `rows` decode rows (the engine's max_num_seqs; CUDA graphs pad up to
    it), and counted in the device memory plan (`SparsePolicy.decode_buffer_tokens`)."""

    rows: int
    num_layers: int
    buffers: dict[int, tuple[Tensor, Tensor, Tensor, Tensor]] = field(default_factory=dict)
    loaded: Tensor | None = None     # [layers, (EARLY, LATE)] int64 pages loaded into slots (device)
    disabled: bool = False           # a buffer could not be allocated: no new ones

    def layer(self, layer: int, kv_heads: int, slots: int, page_size: int, head_dim: int,
              dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
        """(k, v [rows, KVH, slots * page_size, D], held [rows, KVH, slots], owner [rows, KVH]),
        or None where the device had no memory for them (then steps gather as without)."""
        shape = (self.rows, kv_heads, slots * page_size, head_dim)
        found = self.buffers.get(layer)
        if found is not None and tuple(found[0].shape) == shape:
            return found
        if self.disabled:
            return None
        try:
            found = (torch.empty(shape, dtype=dtype, device=device),
                     torch.empty(shape, dtype=dtype, device=device),
                     torch.full(shape[:2] + (slots,), -1, dtype=torch.int64, device=device),
                     torch.full(shape[:2], -1, dtype=torch.int64, device=device))
        except torch.cuda.OutOfMemoryError:
            # Buffers already handed out stay: a captured graph may still read them.
            log.warning("Quest reuse_pages: no device memory for a layer's page buffers (%d "
                        "bytes); its steps load every selected page",
                        2 * torch.Size(shape).numel() * dtype.itemsize)
            self.disabled = True
            return None
        self.buffers[layer] = found
        if self.loaded is None:
            self.loaded = torch.zeros(self.num_layers, 2, dtype=torch.int64, device=device)
        return found

    def pages_loaded(self) -> tuple[list[int], list[int]]:
        """Pages loaded into slots per layer, (by prefetches, by the layers themselves):
        reads the device counters."""
        if self.loaded is None:
            return [0] * self.num_layers, [0] * self.num_layers
        early, late = self.loaded.cpu().unbind(1)
        return early.tolist(), late.tolist()
