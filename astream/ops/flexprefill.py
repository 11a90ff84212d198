"""FlexPrefill (Lai et al., ICLR 2025) for prefill: the estimate from the chunk's last query
block, the per-head choice between a query-aware and a vertical-slash pattern, and the
block mask that grows until the estimated attention mass reaches gamma.

One sequence at a time, as astream.ops.xattention: q [Tq, H, D] is a prefill chunk, k
[Tk, KVH, D] every key it attends to (its prefix, then itself), causal bottom-right. Query
blocks are `block` rows of the chunk, key blocks `block` keys from the start; the attention
over the mask is astream.ops.xattention's block-sparse kernel.

The estimate, per query head, from the chunk's last query block (its last `block` rows, or
all of a shorter chunk), attending (softmax, causal) to every key:
- vertical [H, n_kb]: its mean weight on each key block (each row sums to 1);
- slash [H, n_kb]: its mean weight on each diagonal block, the keys at a distance
  position - key in [d * block, (d + 1) * block) from the row;
- pooled [H, n_kb]: the same rows' mean query against each key block's mean key, a softmax
  over the key blocks: the cheap estimate the query-aware pattern is built from.

The choice: a head is query-aware when the square-root Jensen-Shannon divergence (natural
log) between pooled and vertical is below `tau`, i.e. when block-pooled Q and K predict
the head's true attention well; otherwise it is vertical-slash.

The selection, per head. A ranked cover of scores keeps, forced entries first and then the
highest scores (ties to the lower index), the fewest entries whose mass reaches gamma of
the total; gamma >= 1 keeps every entry.
- Vertical-slash heads keep the cover of vertical (key block 0 forced) and the cover of
  slash (diagonal block 0 forced), each count clamped to [min_blocks, max_blocks]. Query
  block i reads the kept key blocks and, for a kept diagonal block d, key block last_i - d
  (last_i: the last key block it sees).
- Query-aware heads keep min_blocks of each (the floor), and the cover, over every
  (query block, visible key block) pair of the head at once, of each query block's mean
  query against each key block's mean key (a softmax over the visible key blocks per query
  block, so the total is the number of query blocks).
Every query block also reads key block 0 and its causal diagonal blocks; what is not
causally visible is never read. gamma >= 1 is exactly full attention, and so is a
min_blocks that covers every key block.

Everything runs on the device, with no host read of a device value. On CUDA the last block's
vertical and slash sums are Triton kernels that never form its weights
(astream.ops.triton_flexprefill); their torch reference, the CPU path, forms the weights a
few query heads at a time (ESTIMATE_BYTES). Block means read their rows in slices, so memory
stays bounded at long contexts (at a million keys one head's weights are 512 MiB).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from astream.ops.attention import select_decode_backend
from astream.ops.attention_ref import ESTIMATE_BYTES, grouped_scores, head_slices
from astream.ops.xattention import visible_blocks, visible_mask

MEAN_ROWS = 1 << 16             # rows of K (or Q) a block mean reads at a time


class Estimate(NamedTuple):
    vertical: Tensor        # [H, n_kb] float32: the last block's mean weight per key block
    slash: Tensor           # [H, n_kb] float32: its mean weight per diagonal block
    pooled: Tensor          # [H, n_kb] float32: mean query vs block-mean keys, softmax


def block_means(x: Tensor, block: int) -> Tensor:
    """[T, KVH or H, D] -> [heads, ceil(T/block), D] float32: the mean of each block's rows
    (a short last block is the mean of the rows it has). Rows are read MEAN_ROWS at a time:
    a float32 copy of a million keys would be 4 GiB."""
    rows, heads, dim = x.shape
    n_b = -(-rows // block)
    sums = torch.empty(n_b, heads, dim, dtype=torch.float32, device=x.device)
    step = max(block, MEAN_ROWS - MEAN_ROWS % block)
    for r0 in range(0, rows, step):
        part = x[r0:r0 + step].float()
        pad = -part.shape[0] % block
        part = torch.nn.functional.pad(part, (0, 0, 0, 0, 0, pad)) if pad else part
        sums[r0 // block:r0 // block + part.shape[0] // block] = part.view(-1, block, heads, dim).sum(1)
    counts = torch.full((n_b,), float(block), device=x.device)
    counts[-1] = rows - (n_b - 1) * block
    return (sums / counts.view(-1, 1, 1)).transpose(0, 1)


def _or_block_means(key_means: Tensor | None, k: Tensor, block: int) -> Tensor:
    """key_means [KVH, n_kb, D] as given (checked against k), else `block_means(k, block)`."""
    if key_means is None:
        return block_means(k, block)
    want = (k.shape[1], -(-k.shape[0] // block), k.shape[2])
    if tuple(key_means.shape) != want:
        raise ValueError(f"key_means of shape {tuple(key_means.shape)}: keys {tuple(k.shape)} in "
                         f"blocks of {block} have block means of shape {want}")
    return key_means


def last_block_estimate(q: Tensor, k: Tensor, *, block: int, scale: float,
                        key_means: Tensor | None = None) -> Estimate:
    """The estimate of each query head (see the module docstring); its vertical and slash
    sums are the Triton kernels of astream.ops.triton_flexprefill on CUDA, and
    `last_block_sums_ref` (their reference) elsewhere. key_means: `block_means(k, block)`,
    where the caller has it already."""
    n_q, n_heads, _ = q.shape
    group = n_heads // k.shape[1]
    rows = q[n_q - min(block, n_q):]
    if select_decode_backend(q.device) == "triton" and block >= 16 and not block & (block - 1):
        from astream.ops.triton_flexprefill import last_block_sums_triton
        vertical, slash = last_block_sums_triton(rows, k, block=block, scale=scale)
    else:
        vertical, slash = last_block_sums_ref(rows, k, block=block, scale=scale)
    mean_query = rows.float().mean(0)                                       # [H, D]
    keys = _or_block_means(key_means, k, block).repeat_interleave(group, dim=0)  # [H, n_kb, D]
    pooled = torch.softmax(torch.einsum("hd,hbd->hb", mean_query, keys) * scale, dim=-1)
    return Estimate(vertical, slash, pooled)


def last_block_sums_ref(rows: Tensor, k: Tensor, *, block: int, scale: float) -> tuple[Tensor, Tensor]:
    """(vertical, slash) [H, n_kb] float32 of the chunk's last rows [R, H, D] (the last at
    position len(k) - 1), attending causally to every key k [Tk, KVH, D]."""
    last, n_heads, _ = rows.shape
    n_k, kv_heads, _ = k.shape
    group = n_heads // kv_heads
    n_kb = -(-n_k // block)
    positions = torch.arange(n_k - last, n_k, device=k.device)
    hidden = torch.arange(n_k, device=k.device).view(1, -1) > positions.view(-1, 1)
    # Row at position p puts diagonal block d on keys (p - (d+1) * block, p - d * block]: a
    # difference of its cumulative weights, read at two columns per block.
    top = positions.view(-1, 1) - torch.arange(n_kb, device=k.device).view(1, -1) * block
    upper, lower = (top + 1).clamp(0, n_k), (top + 1 - block).clamp(0, n_k)
    rows = rows.float()
    vertical = torch.empty(n_heads, n_kb, dtype=torch.float32, device=k.device)
    slash = torch.empty_like(vertical)
    # A head's scores, then its weights and their cumulative sums, are alive at once.
    for h0, h1 in head_slices(n_heads, group, last * (n_k + 1) * 4 * 3, ESTIMATE_BYTES):
        scores = grouped_scores(rows, k, h0, h1, group) * scale
        probs = torch.softmax(scores.masked_fill_(hidden, float("-inf")), dim=-1)
        del scores
        padded = torch.nn.functional.pad(probs.mean(1), (0, n_kb * block - n_k))
        vertical[h0:h1] = padded.view(h1 - h0, n_kb, block).sum(-1)
        cum = torch.nn.functional.pad(probs.cumsum_(-1), (1, 0))          # [h, L, Tk + 1]
        del probs
        per_row = cum.gather(-1, upper.expand(h1 - h0, -1, -1)) \
            - cum.gather(-1, lower.expand(h1 - h0, -1, -1))
        slash[h0:h1] = per_row.mean(1)
    return vertical, slash


def js_distance(p: Tensor, q: Tensor) -> Tensor:
    """Square root of the Jensen-Shannon divergence (natural log) of distributions along the
    last dimension; 0 * log 0 counts as 0."""
    m = (p + q) / 2
    half = torch.xlogy(p, p) - torch.xlogy(p, m) + torch.xlogy(q, q) - torch.xlogy(q, m)
    return (0.5 * half.sum(-1)).clamp(min=0).sqrt()


def query_aware_scores(q: Tensor, k: Tensor, *, block: int, scale: float,
                       key_means: Tensor | None = None) -> Tensor:
    """[H, n_qb, n_kb] float32: each query block's mean query against each key block's mean
    key, a softmax over the key blocks it sees (0 where it sees none). key_means:
    `block_means(k, block)`, where the caller has it already."""
    n_q, n_heads, _ = q.shape
    n_k, kv_heads, _ = k.shape
    queries = block_means(q, block)                                          # [H, n_qb, D]
    keys = _or_block_means(key_means, k, block).repeat_interleave(n_heads // kv_heads, dim=0)
    scores = torch.matmul(queries, keys.transpose(1, 2)) * scale
    visible = visible_mask(n_heads, n_q, n_k, block, q.device)
    return torch.softmax(scores.masked_fill_(~visible, float("-inf")), dim=-1)


def ranked_cover(scores: Tensor, gamma: float, *, forced: Tensor | None = None,
                 valid: Tensor | None = None, low: int | Tensor = 0,
                 high: int | Tensor | None = None) -> Tensor:
    """Bool mask like scores [R, n]: per row, forced entries first, then the highest valid
    scores (ties to the lower index), the fewest whose mass reaches gamma of the row's valid
    total (every valid entry when gamma >= 1), their count clamped to [low, high] (ints, or
    [R] tensors) and never below the forced ones; never an invalid entry."""
    valid = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid
    forced = torch.zeros_like(valid) if forced is None else forced & valid
    ranked = torch.where(forced, float("inf"), torch.where(valid, scores.float(), -1.0))
    order = ranked.argsort(dim=-1, descending=True, stable=True)
    mass = torch.where(valid, scores.float().clamp(min=0), 0.0).gather(-1, order)
    available = valid.sum(-1)
    if gamma >= 1.0:
        count = available
    else:
        before = mass.cumsum(-1) - mass
        count = (before < gamma * mass.sum(-1, keepdim=True)).sum(-1)
        count = torch.maximum(count, _per_row(low, count))
        if high is not None:
            count = torch.minimum(count, _per_row(high, count))
    count = torch.minimum(torch.maximum(count, forced.sum(-1)), available)
    rank = torch.arange(scores.shape[-1], device=scores.device)
    keep = torch.zeros_like(valid)
    return keep.scatter_(-1, order, rank < count.unsqueeze(-1))


def _per_row(bound: int | Tensor, like: Tensor) -> Tensor:
    return bound.to(like) if isinstance(bound, Tensor) else torch.full_like(like, bound)


def select_blocks(est: Estimate, qa_scores: Tensor, *, gamma: float, tau: float, min_blocks: int,
                  max_blocks: int | None, n_q: int, n_k: int,
                  block: int) -> tuple[Tensor, Tensor]:
    """(block mask [H, n_qb, n_kb] bool, query-aware heads [H] bool); see the module docstring."""
    n_heads, n_kb = est.vertical.shape
    device = est.vertical.device
    visible = visible_mask(n_heads, n_q, n_k, block, device)
    query_aware = js_distance(est.pooled, est.vertical) < tau
    if gamma >= 1.0:
        return visible.clone(), query_aware
    first_only = torch.zeros(n_heads, n_kb, dtype=torch.bool, device=device)
    first_only[:, 0] = True
    # A query-aware head keeps min_blocks of each, a vertical-slash head the cover, clamped.
    cap = torch.full((n_heads,), n_kb if max_blocks is None else max_blocks, device=device)
    high = torch.where(query_aware, min_blocks, cap)
    vertical = ranked_cover(est.vertical, gamma, forced=first_only, low=min_blocks, high=high)
    slash = ranked_cover(est.slash, gamma, forced=first_only, low=min_blocks, high=high)
    first, last = visible_blocks(n_q, n_k, block, device)
    cols = torch.arange(n_kb, device=device).view(1, -1)
    distance = (last.view(-1, 1) - cols).clamp(min=0)                        # [n_qb, n_kb]
    on_slash = slash.gather(1, distance.view(1, -1).expand(n_heads, -1)).view_as(visible)
    forced = (cols == 0) | (cols >= first.view(-1, 1))
    aware = ranked_cover(qa_scores.flatten(1), gamma, valid=visible.flatten(1)).view_as(visible)
    aware &= query_aware.view(-1, 1, 1)
    return visible & (vertical.unsqueeze(1) | on_slash | forced | aware), query_aware


def block_budget(tokens: int, block: int) -> int:
    """Key blocks a budget of `tokens` keys gives (rounded up)."""
    return -(-tokens // block)
