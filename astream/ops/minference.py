"""MInference's vertical-slash pattern (Jiang et al., NeurIPS 2024) for prefill: the index
built from the chunk's last queries, the pattern it defines, and attention over it.

One sequence at a time: q [Tq, H, D] is a prefill chunk, k/v [Tk, KVH, D] every key it
attends to (its prefix, then itself), causal bottom-right (query t sits at position
t + Tk - Tq and sees keys u at or before it).

The index, per query head: the chunk's last `last_q` queries attend (softmax, causal) to
every key; a key column's score is its summed weight, a diagonal's (distance
delta = position - u) the summed weight along it. The top `vertical_size` columns are kept,
always the first `sink` ones, and the top `slash_size` diagonals, always the nearest
`local` ones.

The pattern, per query block of `block` rows starting at row s: the kept columns, and for
every kept diagonal the band of keys it crosses within the block, [s + offset - delta,
s + block - 1 + offset - delta] (a whole block-wide band, as the kernel reads it, not a
one-key line), then causal. With sizes that cover every column, the pattern is full attention.

`vertical_slash_layout` turns the index into what the kernel walks: per (head, query
block) the bands merged into disjoint key runs, and the kept columns that no run covers.
On CUDA the attention is a Triton kernel (astream.ops.triton_minference); the torch
functions here are its reference (dense attention masked to the pattern) and the CPU path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from astream.ops.attention import select_decode_backend
from astream.ops.attention_ref import (
    ESTIMATE_BYTES, _softmax_rows, grouped_scores, head_slices, masked_attention_ref,
)


class VerticalSlash(NamedTuple):
    verticals: Tensor       # [H, V] int64 key columns, ascending
    slashes: Tensor         # [H, S] int64 diagonal distances, descending (bands left to right)


class Layout(NamedTuple):
    run_start: Tensor       # [H, n_qb, R] int32 key runs [start, end), ascending, disjoint
    run_end: Tensor
    run_count: Tensor       # [H, n_qb] int32
    columns: Tensor         # [H, n_qb, V] int32 kept columns outside every run, ascending
    column_count: Tensor    # [H, n_qb] int32


def last_query_weights(q: Tensor, k: Tensor, last_q: int, scale: float,
                       heads: tuple[int, int] | None = None) -> Tensor:
    """Softmax weights [H, L, Tk] float32 of the chunk's last L queries over every key (of
    the query heads `heads` [h0, h1) only, when given)."""
    n_q, n_heads, _ = q.shape
    n_k, kv_heads, _ = k.shape
    h0, h1 = heads or (0, n_heads)
    last = min(last_q, n_q)
    rows = torch.arange(n_q - last, n_q, device=q.device) + (n_k - n_q)
    scores = grouped_scores(q[n_q - last:].float(), k, h0, h1, n_heads // kv_heads) * scale
    hidden = torch.arange(n_k, device=q.device).view(1, -1) > rows.view(-1, 1)
    probs, _ = _softmax_rows(scores.masked_fill_(hidden, float("-inf")))
    return probs


def vertical_slash_index(q: Tensor, k: Tensor, *, last_q: int, vertical_size: int, slash_size: int,
                         sink: int, local: int, scale: float) -> VerticalSlash:
    """The kept columns and diagonals of each query head (see the module docstring). The
    weights are formed a few query heads at a time (ESTIMATE_BYTES): at a million keys one
    head's are 256 MiB."""
    n_q, n_heads, _ = q.shape
    n_k, kv_heads, _ = k.shape
    last = min(last_q, n_q)
    vertical = torch.empty(n_heads, n_k, dtype=torch.float32, device=q.device)
    slash = torch.empty_like(vertical)
    # Row i of the last queries sits at position n_k - last + i; its weight on key u lies on
    # diagonal delta = n_k - last + i - u. Shifted right by last - 1 - i, every row puts
    # diagonal delta in column n_k - 1 - delta (zeros enter from the left padding).
    shift = torch.arange(last, device=q.device).view(-1, 1) + 1
    cols = (torch.arange(n_k, device=q.device).view(1, -1) + shift).view(1, last, n_k)
    # A head's weights, their padded copy and the aligned rows are alive at once.
    head_bytes = last * (n_k + last) * 4 * 3
    for h0, h1 in head_slices(n_heads, n_heads // kv_heads, head_bytes, ESTIMATE_BYTES):
        probs = last_query_weights(q, k, last_q, scale, (h0, h1))                  # [h, L, Tk]
        vertical[h0:h1] = probs.sum(1)
        padded = torch.nn.functional.pad(probs, (last, 0))                      # [h, L, last + Tk]
        del probs
        slash[h0:h1] = padded.gather(2, cols.expand(h1 - h0, -1, -1)).sum(1)
        del padded
    slash = slash.flip(-1)                       # [H, Tk]: index delta = distance to the diagonal
    vertical[:, :sink] = float("inf")
    slash[:, :local] = float("inf")
    verticals = vertical.topk(min(vertical_size, n_k), dim=-1).indices.sort(-1).values
    slashes = slash.topk(min(slash_size, n_k), dim=-1).indices.sort(-1, descending=True).values
    return VerticalSlash(verticals, slashes)


def vertical_slash_mask_ref(index: VerticalSlash, n_q: int, n_k: int, block: int, head: int) -> Tensor:
    """The pattern of one query head as a dense [Tq, Tk] bool mask, causal included. The
    bands are counted with +1 / -1 marks and a running sum (not merged as the layout does)."""
    device = index.verticals.device
    offset = n_k - n_q
    rows = torch.arange(n_q, device=device)
    first = torch.arange(0, n_q, block, device=device)
    starts = (first + offset).view(-1, 1) - index.slashes[head].view(1, -1)     # [n_qb, S]
    marks = torch.zeros(first.numel(), n_k + 1, dtype=torch.int32, device=device)
    ones = torch.ones_like(starts, dtype=torch.int32)
    marks.scatter_add_(1, starts.clamp(0, n_k), ones)
    marks.scatter_add_(1, (starts + block).clamp(0, n_k), -ones)
    keep = (marks.cumsum(1)[:, :n_k] > 0)[rows // block]
    keep[:, index.verticals[head]] = True
    return keep & (torch.arange(n_k, device=device).view(1, -1) <= rows.view(-1, 1) + offset)


def vertical_slash_attention_ref(q: Tensor, k: Tensor, v: Tensor, index: VerticalSlash, *,
                                 block: int, scale: float) -> tuple[Tensor, Tensor]:
    """Dense attention masked to the pattern -> out [Tq, H, D], lse [Tq, H] float32."""
    n_q, n_k = q.shape[0], k.shape[0]
    return masked_attention_ref(q, k, v, lambda h: vertical_slash_mask_ref(index, n_q, n_k, block, h),
                                scale=scale)


def vertical_slash_layout(index: VerticalSlash, n_q: int, n_k: int, block: int) -> Layout:
    """Per (head, query block): the diagonal bands merged into disjoint key runs, clipped to
    what the block can see, and the kept columns no run covers (device ops, no host sync)."""
    device = index.verticals.device
    offset = n_k - n_q
    first = torch.arange(0, n_q, block, device=device)
    visible_end = (torch.clamp(first + block, max=n_q) + offset).view(1, -1, 1)   # exclusive
    starts = (first + offset).view(1, -1, 1) - index.slashes.unsqueeze(1)         # [H, n_qb, S]
    ends = starts + block
    # Equal-width bands in ascending order merge where a band starts before the last ends.
    new_run = torch.ones_like(starts, dtype=torch.bool)
    new_run[..., 1:] = starts[..., 1:] > ends[..., :-1]
    run_id = new_run.cumsum(-1) - 1
    run_start = torch.full_like(starts, n_k + 1).scatter_reduce(-1, run_id, starts, "amin")
    run_end = torch.zeros_like(ends).scatter_reduce(-1, run_id, ends, "amax")
    run_start = run_start.clamp(min=0)
    run_end = torch.minimum(run_end, visible_end)
    columns = index.verticals.unsqueeze(1).expand(-1, first.numel(), -1)
    inside = torch.searchsorted(run_start.contiguous(), columns.contiguous(), right=True) - 1
    covered = (inside >= 0) & (columns < run_end.gather(-1, inside.clamp(min=0)))
    keep = ~covered & (columns < visible_end)
    order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)
    return Layout(run_start.int(), run_end.int(), new_run.sum(-1, dtype=torch.int32),
                  columns.gather(-1, order).int(), keep.sum(-1, dtype=torch.int32))


def layout_density(layout: Layout, n_q: int, n_k: int, block: int) -> tuple[Tensor, int]:
    """(keys the blocks read, summed over heads and blocks, as a device scalar; the keys
    they could see, a host int): a block's keys are its runs' lengths plus its columns."""
    offset = n_k - n_q
    spans = (layout.run_end - layout.run_start).clamp(min=0).sum(dtype=torch.int64)
    read = spans + layout.column_count.sum(dtype=torch.int64)
    visible = sum(min(start + block, n_q) + offset for start in range(0, n_q, block))
    return read, visible * layout.run_count.shape[0]


def vertical_slash_attention(q: Tensor, k: Tensor, v: Tensor, index: VerticalSlash, *,
                             block: int, scale: float,
                             layout: Layout | None = None) -> tuple[Tensor, Tensor]:
    """`vertical_slash_attention_ref`'s contract; the Triton kernel on CUDA."""
    if select_decode_backend(q.device) == "triton":
        from astream.ops import triton_minference
        if layout is None:
            layout = vertical_slash_layout(index, q.shape[0], k.shape[0], block)
        return triton_minference.vertical_slash_attention_triton(q, k, v, layout, block=block,
                                                                 scale=scale)
    return vertical_slash_attention_ref(q, k, v, index, block=block, scale=scale)
