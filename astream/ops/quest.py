"""Quest (Tang et al., ICML 2024) device-side ops: the key bounds of every page. Which
pages a query selects from them: astream.ops.quest_select; pages themselves (ids,
attention over chosen pages, the gather from a host pool): astream.ops.pages.

Bounds describe the keys as the cache stores them, in its element type: min and max
only select stored values, so they are exact in it (float32 would double their memory
for nothing). An fp8 cache stores value / scale with one positive scale per (layer, KV
head): scores from its bounds are those of the dequantized keys divided by the head's
scale, so they rank a head's pages alike, from half the bytes of bf16 bounds.

No op here reads a device value on the host, and every output shape follows from input
shapes and host ints, so all of them can run inside a captured CUDA graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

from astream.ops.attention import select_decode_backend
from astream.ops.kv_write import as_bytes
from astream.ops.pages import pages_per_block

DEFAULT_PAGE_SIZE = 16
GQA_REDUCTIONS = ("max", "sum", "relative")


def allocate_page_bounds(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, *,
                         dtype: torch.dtype, device: torch.device | str,
                         page_size: int = DEFAULT_PAGE_SIZE) -> tuple[Tensor, Tensor]:
    """Empty bounds for every page of `num_blocks` blocks (count a scratch block in too).

    Returns kmin, kmax [num_blocks * ppb, kv_heads, head_dim] in `dtype`, set to +inf / -inf
    (the identities of min / max; the largest finite values in a type without infinities,
    float8_e4m3fn), so an unwritten page bounds nothing.
    """
    shape = (num_blocks * pages_per_block(block_size, page_size), kv_heads, head_dim)
    top = _empty_bound(dtype)
    return (torch.full(shape, top, dtype=dtype, device=device),
            torch.full(shape, -top, dtype=dtype, device=device))


def _empty_bound(dtype: torch.dtype) -> float:
    """An empty page's kmin (its kmax is the negation): +inf, or the largest finite value of
    a type without infinities."""
    return torch.finfo(dtype).max if dtype == torch.float8_e4m3fn else float("inf")


def update_page_bounds(kmin: Tensor, kmax: Tensor, keys: Tensor, slots: Tensor,
                       page_size: int = DEFAULT_PAGE_SIZE) -> None:
    """Fold keys [T, KVH, D] just written at flat cache slots [T] (int64) into the bounds.

    A page whose first token (page offset 0) is among the new tokens is being (re)filled,
    so it is reset first: that makes prefill chunks, single decode tokens and pages reused
    after a free all exact. Padding rows may target one scratch slot many times. On CUDA
    one Triton kernel (a page's new tokens must be consecutive rows, as one sequence's are).
    """
    if select_quest_backend(keys.device) == "triton":
        from astream.ops import triton_quest_select
        triton_quest_select.update_page_bounds_triton(kmin, kmax, keys, slots, page_size)
        return
    if keys.shape[0] == 0:
        return
    # In float32 over the touched pages' rows, read and written as bytes: no float8 type
    # has min/max or scatter kernels on the CPU. Rows sorted by page make each page one
    # run; every row of a run writes the run's result, so duplicate writes agree.
    pages, order = torch.sort(slots.long() // page_size, stable=True)
    rows = torch.arange(pages.shape[0], device=pages.device)
    run_start = torch.ones_like(pages, dtype=torch.bool)
    run_start[1:] = pages[1:] != pages[:-1]
    first = torch.cummax(torch.where(run_start, rows, 0), 0).values
    restart = torch.zeros_like(pages).scatter_reduce_(
        0, first, (slots.long()[order] % page_size == 0).long(), "amax").bool()[first]
    index = first.view(-1, 1, 1).expand(-1, *keys.shape[1:])
    keys = keys[order].float()
    for bounds, reduce, empty in ((kmin, "amin", float("inf")), (kmax, "amax", float("-inf"))):
        held = as_bytes(bounds).index_select(0, pages).view(bounds.dtype).float()
        held = torch.where(restart.view(-1, 1, 1), empty, held)
        folded = held.scatter_reduce_(0, index, keys, reduce)[first]
        as_bytes(bounds).index_copy_(0, pages, as_bytes(folded.to(bounds.dtype)))


def bounds_of_blocks(keys_blocks: Tensor, page_size: int = DEFAULT_PAGE_SIZE,
                     num_valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Bounds of whole blocks: keys_blocks [n, block_size, KVH, D] -> kmin, kmax [n*ppb, KVH, D].

    num_valid [n] (optional) counts the written tokens of each block; the rest are ignored
    (a page with none gets allocate_page_bounds' empty bounds). Output dtype = keys' dtype.
    """
    n, block_size, kv_heads, head_dim = keys_blocks.shape
    ppb = pages_per_block(block_size, page_size)
    lo = hi = keys_blocks.float()              # float8 has no masked_fill or min on the CPU
    if num_valid is not None:
        hidden = torch.arange(block_size, device=keys_blocks.device) >= num_valid.view(-1, 1)
        hidden = hidden.view(n, block_size, 1, 1)
        lo = lo.masked_fill(hidden, float("inf"))
        hi = hi.masked_fill(hidden, float("-inf"))
    top = _empty_bound(keys_blocks.dtype)
    kmin, kmax = (reduce(side.unflatten(1, (ppb, page_size)), dim=2).clamp(-top, top)
                  .reshape(n * ppb, kv_heads, head_dim).to(keys_blocks.dtype)
                  for side, reduce in ((lo, torch.amin), (hi, torch.amax)))
    return kmin, kmax


def store_block_bounds(kmin: Tensor, kmax: Tensor, keys_blocks: Tensor, blocks: Tensor,
                       page_size: int = DEFAULT_PAGE_SIZE,
                       num_valid: Tensor | None = None) -> None:
    """Overwrite the bounds of the pages of blocks [n] (int64) with those of keys_blocks."""
    ppb = pages_per_block(keys_blocks.shape[1], page_size)
    pages = (blocks.long().view(-1, 1) * ppb + torch.arange(ppb, device=blocks.device)).view(-1)
    lo, hi = bounds_of_blocks(keys_blocks, page_size, num_valid)
    for bounds, side in ((kmin, lo), (kmax, hi)):
        as_bytes(bounds).index_copy_(0, pages, as_bytes(side.to(bounds.dtype)))


def select_quest_backend(device: torch.device | str) -> str:
    """Backend of the Quest ops for tensors on `device`: "triton" | "reference". They are
    built on the decode kernels' Triton pieces, so the decode rule decides for both."""
    return select_decode_backend(device)
