"""Triton kernel of Quest's page reuse plan (CUDA; also run under TRITON_INTERPRET=1). The
torch reference and the contract: astream.policies.quest.page_reuse.plan_reuse.

Grid (row, KV head): one program owns a row's slots for one KV head, so it reads what they
hold once, keeps it in registers and writes it back once; no other program touches them.
Two passes over the wanted pages, in tiles: the first marks the slots that hold a wanted
page, the second gives each hit its slot and each miss, in order, the next free slot. In
the torch reference the same plan is about forty small kernels a layer, which cost an
offloaded step more than the loads they save.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

TILE_ELEMENTS = 8192        # (wanted page, slot) pairs compared at once


@triton.jit
def _plan_reuse_kernel(
    held_ptr, owner_ptr, want_ptr, counts_ptr, owners_ptr, page_list_ptr, load_to_ptr, loaded_ptr,
    stride_hr, stride_hh, stride_or, stride_oh, stride_wr, stride_wh, stride_cr, stride_ch,
    stride_lr, stride_lh, stride_tr, stride_th, width, slots,
    C_PAD: tl.constexpr, P_TILE: tl.constexpr,
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
    used = tl.zeros([C_PAD], tl.int32)
    for start in range(0, width, P_TILE):
        pos = start + tl.arange(0, P_TILE)
        pages = tl.load(want_row + pos, mask=pos < n, other=-2)     # -2: no page, no slot
        match = (pages[:, None] == held[None, :]) & (held[None, :] >= 0)
        used = tl.maximum(used, tl.max(match.to(tl.int32), axis=0))
    free = in_slots & (used == 0)
    free_rank = tl.cumsum(free.to(tl.int32), axis=0) - 1
    misses = tl.zeros([], tl.int32)
    new_held = held
    for start in range(0, width, P_TILE):
        pos = start + tl.arange(0, P_TILE)
        wanted = pos < n
        pages = tl.load(want_row + pos, mask=wanted, other=-2)
        match = (pages[:, None] == held[None, :]) & (held[None, :] >= 0)
        hit = tl.max(match.to(tl.int32), axis=1) > 0
        miss = wanted & ~hit
        # The k-th miss takes the k-th free slot: there are at least as many free slots.
        miss_rank = misses + tl.cumsum(miss.to(tl.int32), axis=0) - 1
        take = (miss_rank[:, None] == free_rank[None, :]) & free[None, :] & miss[:, None]
        slot = tl.where(hit, tl.max(tl.where(match, lanes[None, :], -1), axis=1),
                        tl.max(tl.where(take, lanes[None, :], -1), axis=1))
        in_width = pos < width
        tl.store(page_list_ptr + r * stride_lr + h * stride_lh + pos,
                 tl.where(wanted, slot, 0), mask=in_width)
        tl.store(load_to_ptr + r * stride_tr + h * stride_th + pos,
                 tl.where(miss, slot, -1).to(tl.int64), mask=in_width)
        landed = tl.max(take.to(tl.int32), axis=0) > 0
        new_held = tl.where(landed, tl.max(tl.where(take, pages[:, None], -1), axis=0), new_held)
        misses += tl.sum(miss.to(tl.int32), axis=0)
    tl.store(held_row + lanes, new_held, mask=in_slots)
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
    _plan_reuse_kernel[(rows, kv_heads)](
        held, owner, want, counts, owners.contiguous(), page_list, load_to, loaded,
        held.stride(0), held.stride(1), *owner.stride(), want.stride(0), want.stride(1),
        *counts.stride(), page_list.stride(0), page_list.stride(1), load_to.stride(0),
        load_to.stride(1), width, slots, C_PAD=c_pad, P_TILE=tile, num_warps=8,
    )
    return page_list, load_to
