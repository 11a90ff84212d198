"""Triton kernel of Quest's page reuse plan (CUDA; also run under TRITON_INTERPRET=1). The
torch reference and the contract: astream.policies.quest.page_reuse.plan_reuse.

Grid (row, KV head): one program owns a row's slots for one KV head, so it reads what they
hold once and writes them back once; no other program touches them. The plan sits between
a layer's selection and its load, on the chain that bounds an offloaded step, so its
latency is what counts. It does one comparison of every wanted page against the slots
(in tiles, a single reduction each: the slot a page sits in), and everything else with
per-lane vectors: a slot is in use where a hit landed (a scatter), the k-th free slot is
found through a table indexed by free rank (a scatter, then a gather), and the k-th miss
reads it. Scatters and the gathers that read them go through scratch memory of the
program's own, with a block barrier between; those loads bypass L1 (`.cg`) so they see
the stores. In the torch reference the same plan is about forty small kernels a layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

TILE_ELEMENTS = 16384       # (wanted page, slot) pairs compared at once
NUM_WARPS = 8


@triton.jit
def _plan_reuse_kernel(
    held_ptr, owner_ptr, want_ptr, counts_ptr, owners_ptr, page_list_ptr, load_to_ptr, loaded_ptr,
    slot_scratch_ptr, hit_scratch_ptr,
    stride_hr, stride_hh, stride_or, stride_oh, stride_wr, stride_wh, stride_cr, stride_ch,
    stride_lr, stride_lh, stride_tr, stride_th, width, slots,
    C_PAD: tl.constexpr, P_TILE: tl.constexpr, W_TILE: tl.constexpr, W_PAD: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    lanes = tl.arange(0, C_PAD)
    in_slots = lanes < slots
    epoch = tl.load(owners_ptr + r)
    same = tl.load(owner_ptr + r * stride_or + h * stride_oh) == epoch
    held_row = held_ptr + r * stride_hr + h * stride_hh
    held = tl.load(held_row + lanes, mask=in_slots, other=-1)
    held = tl.where(same, held, -1)           # another life of the table: every slot is empty
    n = tl.load(counts_ptr + r * stride_cr + h * stride_ch)
    want_row = want_ptr + r * stride_wr + h * stride_wh
    program = r * tl.num_programs(1) + h
    slot_scratch = slot_scratch_ptr + program * C_PAD      # in use, then free slots by rank
    hit_scratch = hit_scratch_ptr + program * W_PAD        # each wanted page's slot, -1: miss

    tl.store(slot_scratch + lanes, tl.zeros([C_PAD], tl.int32))
    tl.debug_barrier()
    for start in range(0, width, P_TILE):
        pos = start + tl.arange(0, P_TILE)
        pages = tl.load(want_row + pos, mask=pos < n, other=-2)     # -2: no page, no slot
        match = (pages[:, None] == held[None, :]) & (held[None, :] >= 0)
        hit_slot = tl.max(tl.where(match, lanes[None, :], -1), axis=1)
        tl.store(hit_scratch + pos, hit_slot, mask=pos < width)
        # Wanted pages are distinct, and so are held ones: one hit a slot at most.
        tl.store(slot_scratch + hit_slot, tl.full([P_TILE], 1, tl.int32), mask=hit_slot >= 0)
    tl.debug_barrier()
    used = tl.load(slot_scratch + lanes, cache_modifier=".cg")
    free = in_slots & (used == 0)
    free_rank = tl.cumsum(free.to(tl.int32), axis=0) - 1
    tl.debug_barrier()                         # every lane has read `used` before it is overwritten
    tl.store(slot_scratch + free_rank, lanes, mask=free)
    tl.store(held_row + lanes, held, mask=in_slots)
    tl.debug_barrier()                         # the table is whole, and misses land after the row
    misses = tl.zeros([], tl.int32)
    for start in range(0, width, W_TILE):      # vectors of W_TILE, no pairs: a wider tile
        pos = start + tl.arange(0, W_TILE)
        in_width = pos < width
        wanted = pos < n
        pages = tl.load(want_row + pos, mask=wanted, other=-2)
        hit_slot = tl.load(hit_scratch + pos, mask=in_width, other=-1, cache_modifier=".cg")
        miss = wanted & (hit_slot < 0)
        # The k-th miss takes the k-th free slot: there are at least as many free slots.
        miss_rank = misses + tl.cumsum(miss.to(tl.int32), axis=0) - 1
        miss_slot = tl.load(slot_scratch + miss_rank, mask=miss, other=-1, cache_modifier=".cg")
        slot = tl.where(miss, miss_slot, hit_slot)
        tl.store(page_list_ptr + r * stride_lr + h * stride_lh + pos,
                 tl.where(wanted, slot, 0), mask=in_width)
        tl.store(load_to_ptr + r * stride_tr + h * stride_th + pos,
                 tl.where(miss, miss_slot, -1).to(tl.int64), mask=in_width)
        tl.store(held_row + miss_slot, pages, mask=miss)
        misses += tl.sum(miss.to(tl.int32), axis=0)
    tl.store(owner_ptr + r * stride_or + h * stride_oh, epoch)
    tl.atomic_add(loaded_ptr, misses.to(tl.int64))


def plan_reuse_triton(held: Tensor, owner: Tensor, want: Tensor, counts: Tensor, owners: Tensor,
                      loaded: Tensor) -> tuple[Tensor, Tensor]:
    """See astream.policies.quest.page_reuse.plan_reuse_: updates held [R, KVH, C] and owner [R, KVH]
    in place and adds the loads to loaded [1]; returns (page_list, load_to) [R, KVH, P]."""
    rows, kv_heads, width = want.shape
    slots = held.shape[-1]
    page_list = torch.empty(rows, kv_heads, width, dtype=torch.int32, device=want.device)
    load_to = torch.empty(rows, kv_heads, width, dtype=torch.int64, device=want.device)
    if rows == 0 or width == 0:
        return page_list, load_to
    for name, t in (("held", held), ("want", want)):
        if t.stride(-1) != 1:
            raise ValueError(f"plan_reuse_triton: {name} needs contiguous pages")
    c_pad = triton.next_power_of_2(slots)
    tile = max(8, min(64, TILE_ELEMENTS // c_pad))
    w_tile = max(tile, min(2048, triton.next_power_of_2(width)))     # a multiple of tile
    w_pad = triton.cdiv(width, w_tile) * w_tile
    slot_scratch = torch.empty(rows * kv_heads * c_pad, dtype=torch.int32, device=want.device)
    hit_scratch = torch.empty(rows * kv_heads * w_pad, dtype=torch.int32, device=want.device)
    _plan_reuse_kernel[(rows, kv_heads)](
        held, owner, want, counts, owners.contiguous(), page_list, load_to, loaded,
        slot_scratch, hit_scratch,
        held.stride(0), held.stride(1), *owner.stride(), want.stride(0), want.stride(1),
        *counts.stride(), page_list.stride(0), page_list.stride(1), load_to.stride(0),
        load_to.stride(1), width, slots, C_PAD=c_pad, P_TILE=tile, W_TILE=w_tile, W_PAD=w_pad,
        num_warps=NUM_WARPS,
    )
    return page_list, load_to
