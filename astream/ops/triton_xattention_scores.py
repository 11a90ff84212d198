"""Triton antidiagonal block scoring for XAttention (CUDA; also runs under TRITON_INTERPRET=1).
Reference and contract: astream.ops.xattention.antidiagonal_scores_ref.

Grid (query-group tile, head). A program owns QG stride-groups of queries (several query
blocks) and never forms Q K^T: for each key tile it sums STRIDE small products, query rows
taken in reverse order within their group against key rows in order, which is exactly each
group pair's antidiagonal. The softmax over key groups needs every group's max and sum
before any probability: the products are formed once, each tile's probabilities summed per
key block relative to the tile's own max and kept in a small scratch ([H, Tq/S, Tk/B],
B x S times smaller than Q K^T); once the row's max and sum are final, a second walk
rescales those sums, with no products, into each block x block tile's score.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from astream.ops.triton_tiles import LOG2E, MIN_DOT_DIM, _dim_mask

QUERY_GROUPS = 128       # stride-groups of queries a program owns (a multiple of a block's)
KEY_GROUPS = 64          # stride-groups of keys a tile covers
SCRATCH_BYTES = 256 << 20   # per-block partial sums of one launch (longer chunks are sliced)


@triton.jit
def _estimate(q_ptr, k_ptr, h, kvh, qg, q_ok, last_key, tile, scale_log2, n_q, key_rows,
              stride_qt, stride_qh, stride_kt, stride_kh, HEAD_DIM: tl.constexpr,
              D_PAD: tl.constexpr, STRIDE: tl.constexpr, QG: tl.constexpr, KG: tl.constexpr,
              PRECISION: tl.constexpr):
    """[QG, KG] antidiagonal sums of one key tile in base-2 logits; -inf where not visible."""
    dims = tl.arange(0, D_PAD)
    kg = tile * KG + tl.arange(0, KG)
    acc = tl.zeros([QG, KG], tl.float32)
    for j in range(STRIDE):           # not unrolled: each step's tiles would be staged at once
        q_rows = qg * STRIDE + (STRIDE - 1 - j)
        k_rows = kg * STRIDE + j
        q = tl.load(q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + dims[None, :],
                    mask=_dim_mask(q_rows < n_q, dims, HEAD_DIM, D_PAD), other=0.0)
        k = tl.load(k_ptr + k_rows[:, None] * stride_kt + kvh * stride_kh + dims[None, :],
                    mask=_dim_mask(k_rows < key_rows, dims, HEAD_DIM, D_PAD), other=0.0)
        acc += tl.dot(q.to(k.dtype), tl.trans(k), input_precision=PRECISION)
    visible = q_ok[:, None] & (kg[None, :] * STRIDE <= last_key[:, None])
    return tl.where(visible, acc * scale_log2, float("-inf"))


# Lengths, and the strides that follow them, change with every prompt: specializing on them
# (divisible by 16 or not) would compile the kernel again in the middle of serving.
@triton.jit(do_not_specialize=["n_q", "n_k", "n_qb", "n_kb", "key_rows", "stride_sh", "stride_sq",
                               "stride_ph", "stride_pg", "stride_mh", "stride_mg"])
def _antidiagonal_kernel(
    q_ptr, k_ptr, scores_ptr, part_sum_ptr, part_max_ptr, scale_log2, n_q, n_k, key_rows, n_qb, n_kb,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_sh, stride_sq,
    stride_ph, stride_pg, stride_mh, stride_mg,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, STRIDE: tl.constexpr,
    BLOCK: tl.constexpr, QG: tl.constexpr, KG: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    offset = n_k - n_q
    G: tl.constexpr = BLOCK // STRIDE
    QB: tl.constexpr = QG // G
    KB: tl.constexpr = KG // G
    qg = pid * QG + tl.arange(0, QG)
    q_ok = qg * STRIDE < n_q
    last_key = tl.minimum(qg * STRIDE + STRIDE - 1, n_q - 1) + offset
    last_row = tl.minimum(pid * QG * STRIDE + QG * STRIDE - 1, n_q - 1)
    n_tiles = tl.cdiv((last_row + offset) // STRIDE + 1, KG)
    part_sum = part_sum_ptr + h * stride_ph + qg[:, None] * stride_pg
    part_max = part_max_ptr + h * stride_mh + qg * stride_mg
    # One pass of products: each tile's probabilities are summed per key block relative to
    # the tile's own row max, kept with that max; once every max is known they are rescaled.
    m_i = tl.full([QG], float("-inf"), tl.float32)
    l_i = tl.zeros([QG], tl.float32)
    for tile in range(n_tiles):
        est = _estimate(q_ptr, k_ptr, h, kvh, qg, q_ok, last_key, tile, scale_log2, n_q, key_rows,
                        stride_qt, stride_qh, stride_kt, stride_kh, HEAD_DIM, D_PAD, STRIDE,
                        QG, KG, PRECISION)
        m_tile = tl.max(est, axis=1)
        m_tile_safe = tl.where(m_tile == float("-inf"), 0.0, m_tile)
        block_sums = tl.sum(tl.reshape(tl.exp2(est - m_tile_safe[:, None]), (QG, KB, G)), axis=2)
        tl.store(part_sum + (tile * KB + tl.arange(0, KB))[None, :], block_sums)
        tl.store(part_max + tile, m_tile)
        m_new = tl.maximum(m_i, m_tile)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(block_sums, axis=1) * tl.exp2(m_tile_safe - m_safe)
        m_i = m_new
    tl.debug_barrier()      # the scratch rows were stored by other threads of this program
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    inv_l = tl.where(l_i > 0.0, 1.0 / tl.where(l_i > 0.0, l_i, 1.0), 0.0)
    groups = tl.sum(tl.reshape(q_ok.to(tl.float32), (QB, G)), axis=1)    # real groups per block
    per_group = tl.where(groups > 0.0, 1.0 / tl.where(groups > 0.0, groups, 1.0), 0.0)
    q_blocks = pid * QB + tl.arange(0, QB)
    for tile in range(n_tiles):
        k_blocks = tile * KB + tl.arange(0, KB)
        tile_max = tl.load(part_max + tile)
        weight = tl.where(tile_max == float("-inf"), 0.0, tl.exp2(tile_max - m_safe) * inv_l)
        probs = tl.load(part_sum + k_blocks[None, :]) * weight[:, None]
        sums = tl.sum(tl.reshape(probs, (QB, G, KB)), axis=1)
        tl.store(scores_ptr + h * stride_sh + q_blocks[:, None] * stride_sq + k_blocks[None, :],
                 sums * per_group[:, None],
                 mask=(q_blocks[:, None] < n_qb) & (k_blocks[None, :] < n_kb))


def antidiagonal_scores_triton(q: Tensor, k: Tensor, *, block: int, stride: int,
                               scale: float) -> Tensor:
    """See astream.ops.xattention.antidiagonal_scores_ref; block / stride a power of two."""
    groups = block // stride
    if block % stride or groups & (groups - 1):
        raise ValueError(f"block {block} / stride {stride} must be a power of two")
    n_q, n_heads, _ = q.shape
    n_k = k.shape[0]
    scores = torch.zeros(n_heads, triton.cdiv(n_q, block), triton.cdiv(n_k, block),
                         dtype=torch.float32, device=q.device)
    q, k = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k))
    query_groups = max(QUERY_GROUPS, groups, MIN_DOT_DIM)
    key_groups = max(KEY_GROUPS, groups, MIN_DOT_DIM)
    # Query slices bound the scratch of per-block partial sums; a slice is whole programs
    # (whole query blocks), and its rows see the keys up to its own last row (its last key
    # group is still read whole, as when the chunk is scored at once).
    tiles = triton.cdiv(triton.cdiv(n_k, stride), key_groups)
    row_bytes = n_heads * tiles * (key_groups // groups + 1) * 4 / stride
    rows = max(1, int(SCRATCH_BYTES // (row_bytes * query_groups * stride))) * query_groups * stride
    for start in range(0, n_q, rows):
        end = min(n_q, start + rows)
        _launch(q[start:end], k, n_k - (n_q - end), scores[:, start // block:], block, stride,
                scale, query_groups, key_groups, tiles)
    return scores


def _launch(q: Tensor, k: Tensor, n_k: int, scores: Tensor, block: int, stride: int, scale: float,
            query_groups: int, key_groups: int, tiles: int) -> None:
    """Score q against the first n_k keys (its causal offset is n_k - len(q))."""
    n_q, n_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    key_rows = min(k.shape[0], triton.cdiv(n_k, stride) * stride)
    programs = triton.cdiv(triton.cdiv(n_q, stride), query_groups)
    part_sum = torch.empty(n_heads, programs * query_groups, tiles * (key_groups * stride // block),
                           dtype=torch.float32, device=q.device)
    part_max = torch.empty(n_heads, programs * query_groups, tiles, dtype=torch.float32,
                           device=q.device)
    _antidiagonal_kernel[(programs, n_heads)](
        q, k, scores, part_sum, part_max, scale * LOG2E / stride, n_q, n_k, key_rows,
        triton.cdiv(n_q, block), triton.cdiv(n_k, block), q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), scores.stride(0), scores.stride(1), part_sum.stride(0),
        part_sum.stride(1), part_max.stride(0), part_max.stride(1), GROUP=n_heads // kv_heads,
        HEAD_DIM=head_dim, D_PAD=max(triton.next_power_of_2(head_dim), MIN_DOT_DIM), STRIDE=stride,
        BLOCK=block, QG=query_groups, KG=key_groups,
        PRECISION="ieee" if k.dtype == torch.float32 else "tf32", num_warps=8, num_stages=2,
    )
