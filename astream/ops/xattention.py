"""XAttention (Xu et al., ICML 2025) for prefill: antidiagonal block scoring, the
cumulative-threshold block selection and block-sparse attention over what it keeps.

One sequence at a time: q [Tq, H, D] is a prefill chunk, k/v [Tk, KVH, D] every key it
attends to (its prefix, then itself), causal bottom-right (query t sees keys u <= t + Tk
- Tq). Query blocks are `block` rows of the chunk, key blocks `block` keys from the start.

Scoring reads the S x S sub-blocks of Q K^T only along one antidiagonal each: the queries
of a stride-S group taken in reverse order meet the keys of a group in order, so one
matmul of [Tq/S, S*D] by [S*D, Tk/S] (S times cheaper than Q K^T) gives every group pair's
antidiagonal sum. A softmax over the key groups of each query group (visible ones only)
turns those into attention estimates; summed over each block x block tile and divided by
the query groups of the block, every query block's scores sum to 1. A query block keeps
the fewest key blocks, highest scores first, whose scores reach `threshold`; always the
first key block and the blocks on its causal diagonal; threshold >= 1 keeps every
visible block, which is exactly full attention.

On CUDA the scoring and the block-sparse attention are Triton kernels
(astream.ops.triton_xattention_scores, astream.ops.triton_xattention); these torch
functions are their references and the CPU path. The reference scoring forms a
[H, Tq/S, Tk/S] matrix, fine on the CPU's short prompts; the kernel forms none.
"""

from __future__ import annotations

import torch
from torch import Tensor

from astream.ops.attention import select_decode_backend
from astream.ops.attention_ref import _softmax_rows, masked_attention_ref


def check_shape(block: int, stride: int) -> None:
    if stride < 1 or block < stride or block % stride:
        raise ValueError(f"XAttention block {block} must be a multiple of stride {stride} >= 1")


def _grouped(x: Tensor, stride: int, reverse: bool) -> Tensor:
    """[T, H, D] -> [H, ceil(T/S), S*D] float32: each group of S rows side by side, in
    reverse row order when `reverse` (zero rows pad the last group)."""
    rows, heads, dim = x.shape
    pad = -rows % stride
    x = torch.nn.functional.pad(x.float(), (0, 0, 0, 0, 0, pad))
    groups = x.view(-1, stride, heads, dim)
    if reverse:
        groups = groups.flip(1)
    return groups.permute(2, 0, 1, 3).reshape(heads, -1, stride * dim)


def antidiagonal_scores_ref(q: Tensor, k: Tensor, *, block: int, stride: int,
                            scale: float) -> Tensor:
    """Block scores [H, ceil(Tq/block), ceil(Tk/block)] float32 (see the module docstring);
    invisible blocks score 0."""
    check_shape(block, stride)
    n_q, n_heads, _ = q.shape
    n_k, kv_heads, _ = k.shape
    qg = _grouped(q, stride, reverse=True)                     # [H, Gq, S*D]
    kg = _grouped(k, stride, reverse=False)                    # [KVH, Gk, S*D]
    kg = kg.repeat_interleave(n_heads // kv_heads, dim=0)
    est = torch.matmul(qg, kg.transpose(1, 2)) * (scale / stride)   # [H, Gq, Gk]
    offset = n_k - n_q
    last_query = torch.arange(qg.shape[1], device=q.device) * stride + stride - 1
    first_key = torch.arange(kg.shape[1], device=q.device) * stride
    hidden = first_key.view(1, -1) > (last_query.clamp(max=n_q - 1) + offset).view(-1, 1)
    est.masked_fill_(hidden, float("-inf"))
    probs, _ = _softmax_rows(est)
    per_block = block // stride
    n_qb, n_kb = -(-n_q // block), -(-n_k // block)
    probs = torch.nn.functional.pad(probs, (0, n_kb * per_block - probs.shape[2],
                                            0, n_qb * per_block - probs.shape[1]))
    sums = probs.view(n_heads, n_qb, per_block, n_kb, per_block).sum(dim=(2, 4))
    groups = torch.full((n_qb,), float(per_block), device=q.device)
    groups[-1] = -(-(n_q - (n_qb - 1) * block) // stride)      # the last block may be short
    return sums / groups.view(1, -1, 1)


def visible_blocks(n_q: int, n_k: int, block: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Per query block, its first diagonal key block and its last visible key block [n_qb]."""
    starts = torch.arange(0, n_q, block, device=device)
    ends = (starts + block - 1).clamp(max=n_q - 1)
    offset = n_k - n_q
    return (starts + offset) // block, (ends + offset) // block


def visible_mask(n_heads: int, n_q: int, n_k: int, block: int, device: torch.device) -> Tensor:
    """Every causally visible block [H, n_qb, n_kb] bool: the mask of full attention."""
    _, last = visible_blocks(n_q, n_k, block, device)
    cols = torch.arange(-(-n_k // block), device=device).view(1, -1)
    return (cols <= last.view(-1, 1)).expand(n_heads, -1, -1)


def visible_block_count(n_q: int, n_k: int, block: int) -> int:
    """Causally visible blocks of one head, from host ints (no device read)."""
    offset = n_k - n_q
    return sum((min(start + block - 1, n_q - 1) + offset) // block + 1
               for start in range(0, n_q, block))


def select_blocks_ref(scores: Tensor, *, threshold: float, n_q: int, n_k: int,
                      block: int) -> Tensor:
    """Block mask [H, n_qb, n_kb] bool from scores [H, n_qb, n_kb] (see the module docstring)."""
    visible = visible_mask(scores.shape[0], n_q, n_k, block, scores.device)
    if threshold >= 1.0:
        return visible.clone()
    diag_first, _ = visible_blocks(n_q, n_k, block, scores.device)
    cols = torch.arange(scores.shape[2], device=scores.device).view(1, -1)
    forced = visible & ((cols == 0) | (cols >= diag_first.view(-1, 1)))
    ranked = torch.where(forced, float("inf"), torch.where(visible, scores.float(), -1.0))
    order = ranked.argsort(dim=-1, descending=True, stable=True)
    in_order = scores.float().clamp(min=0).gather(-1, order).masked_fill(
        ~visible.gather(-1, order), 0.0)
    before = in_order.cumsum(-1) - in_order                 # scores of the blocks ranked above
    keep_ranked = (before < threshold) & visible.gather(-1, order)
    mask = torch.zeros_like(visible)
    mask.scatter_(-1, order, keep_ranked)
    return mask | forced


def block_sparse_attention_ref(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, *, block: int,
                               scale: float) -> tuple[Tensor, Tensor]:
    """Causal (bottom-right) attention of q [Tq, H, D] over k/v [Tk, KVH, D] restricted to
    the key blocks mask [H, n_qb, n_kb] keeps -> out [Tq, H, D] (q.dtype), lse [Tq, H] f32."""
    n_q, n_k = q.shape[0], k.shape[0]
    rows = torch.arange(n_q, device=q.device)
    cols = torch.arange(n_k, device=q.device)
    causal = cols.view(1, -1) <= rows.view(-1, 1) + (n_k - n_q)
    return masked_attention_ref(q, k, v, lambda h: mask[h][rows // block][:, cols // block] & causal,
                                scale=scale)


def density(mask: Tensor, n_q: int, n_k: int, block: int) -> float:
    """Share of the causally visible blocks the mask keeps (1.0 = full attention)."""
    return float(mask.sum()) / max(1, mask.shape[0] * visible_block_count(n_q, n_k, block))


def block_sparse_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, *, block: int,
                           scale: float) -> tuple[Tensor, Tensor]:
    """`block_sparse_attention_ref`'s contract; the Triton kernel on CUDA."""
    if select_decode_backend(q.device) == "triton" and block >= 16 and not block & (block - 1):
        from astream.ops import triton_xattention
        return triton_xattention.block_sparse_attention_triton(q, k, v, mask, block=block,
                                                               scale=scale)
    return block_sparse_attention_ref(q, k, v, mask, block=block, scale=scale)


def antidiagonal_scores(q: Tensor, k: Tensor, *, block: int, stride: int, scale: float) -> Tensor:
    """`antidiagonal_scores_ref`'s contract; the Triton kernel on CUDA."""
    check_shape(block, stride)
    groups = block // stride
    if select_decode_backend(q.device) == "triton" and not groups & (groups - 1):
        from astream.ops import triton_xattention_scores
        return triton_xattention_scores.antidiagonal_scores_triton(q, k, block=block, stride=stride,
                                                                   scale=scale)
    return antidiagonal_scores_ref(q, k, block=block, stride=stride, scale=scale)
