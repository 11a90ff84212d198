"""Triton antidiagonal block scoring for XAttention (CUDA; also runs under TRITON_INTERPRET=1).
Reference and contract: astream.ops.xattention.antidiagonal_scores_ref.

Grid (query-group tile, head, key split). A program owns QG stride-groups of queries (several
query blocks) and one share of their key tiles, and never forms Q K^T: for each key tile it
sums STRIDE small products, query rows taken in reverse order within their group against key
rows in order, which is exactly each group pair's antidiagonal. The softmax over key groups
needs every group's max and sum before any probability: the products are formed once, each
tile's probabilities summed per key block relative to the tile's own max and kept in a small
scratch ([H, Tq/S, Tk/B], B x S times smaller than Q K^T), with each split's row max and sum.
A second kernel, with no products, combines the splits' max and sum and rescales the scratch
into each block x block tile's score.

Splitting the keys is what keeps the GPU busy at long prefixes: the scratch bounds how many
query rows one launch may hold (a 1M-token prefix leaves one program per head), so without
it a few dozen programs would walk every key tile in turn.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from astream.ops.triton_tiles import LOG2E, MIN_DOT_DIM, _dim_mask

QUERY_GROUPS = 128       # stride-groups of queries a program owns (a multiple of a block's)
KEY_GROUPS = 128         # stride-groups of keys a tile covers
SCRATCH_BYTES = 256 << 20   # per-block partial sums of one launch (longer chunks are sliced)
PROGRAMS_PER_SM = 2      # key splits are added until a launch has at least this many an SM
MAX_KEY_SPLITS = 64


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


@triton.jit
def _split_tiles(pid, split, splits, n_q, n_k, STRIDE: tl.constexpr, QG: tl.constexpr,
                 KG: tl.constexpr):
    """The key tiles [first, last) of one split of a program's causally visible tiles."""
    last_row = tl.minimum(pid * QG * STRIDE + QG * STRIDE - 1, n_q - 1)
    n_tiles = tl.cdiv((last_row + n_k - n_q) // STRIDE + 1, KG)
    per_split = tl.cdiv(n_tiles, splits)
    first = split * per_split
    return first, tl.minimum(first + per_split, n_tiles)


# Lengths, the strides that follow them and the key splits change with every prompt (the
# splits with its prefix): specializing on them (divisible by 16 or not, or a constant)
# would compile the kernels again in the middle of serving.
@triton.jit(do_not_specialize=["n_q", "n_k", "key_rows", "splits", "stride_ph", "stride_pg",
                               "stride_mh", "stride_mg", "stride_xh", "stride_xg"])
def _partial_kernel(
    q_ptr, k_ptr, part_sum_ptr, part_max_ptr, split_ptr, scale_log2, n_q, n_k, key_rows, splits,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ph, stride_pg, stride_mh, stride_mg,
    stride_xh, stride_xg,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, STRIDE: tl.constexpr,
    BLOCK: tl.constexpr, QG: tl.constexpr, KG: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    kvh = h // GROUP
    G: tl.constexpr = BLOCK // STRIDE
    KB: tl.constexpr = KG // G
    qg = pid * QG + tl.arange(0, QG)
    q_ok = qg * STRIDE < n_q
    last_key = tl.minimum(qg * STRIDE + STRIDE - 1, n_q - 1) + n_k - n_q
    first, last = _split_tiles(pid, split, splits, n_q, n_k, STRIDE, QG, KG)
    part_sum = part_sum_ptr + h * stride_ph + qg[:, None] * stride_pg
    part_max = part_max_ptr + h * stride_mh + qg * stride_mg
    m_i = tl.full([QG], float("-inf"), tl.float32)
    l_i = tl.zeros([QG], tl.float32)
    for tile in range(first, last):
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
    stats = split_ptr + h * stride_xh + qg * stride_xg + split * 2
    tl.store(stats, m_i)
    tl.store(stats + 1, l_i)


@triton.jit(do_not_specialize=["n_q", "n_k", "n_qb", "n_kb", "splits", "stride_sh", "stride_sq",
                               "stride_ph", "stride_pg", "stride_mh", "stride_mg",
                               "stride_xh", "stride_xg"])
def _finish_kernel(
    scores_ptr, part_sum_ptr, part_max_ptr, split_ptr, n_q, n_k, n_qb, n_kb, splits,
    stride_sh, stride_sq, stride_ph, stride_pg, stride_mh, stride_mg, stride_xh, stride_xg,
    STRIDE: tl.constexpr, BLOCK: tl.constexpr, QG: tl.constexpr, KG: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    G: tl.constexpr = BLOCK // STRIDE
    QB: tl.constexpr = QG // G
    KB: tl.constexpr = KG // G
    qg = pid * QG + tl.arange(0, QG)
    q_ok = qg * STRIDE < n_q
    stats = split_ptr + h * stride_xh + qg * stride_xg
    m_i = tl.full([QG], float("-inf"), tl.float32)
    for s in range(splits):
        m_i = tl.maximum(m_i, tl.load(stats + s * 2))
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    l_i = tl.zeros([QG], tl.float32)
    for s in range(splits):           # a split with no visible key holds (-inf, 0): adds 0
        l_i += tl.load(stats + s * 2 + 1) * tl.exp2(tl.load(stats + s * 2) - m_safe)
    inv_l = tl.where(l_i > 0.0, 1.0 / tl.where(l_i > 0.0, l_i, 1.0), 0.0)
    groups = tl.sum(tl.reshape(q_ok.to(tl.float32), (QB, G)), axis=1)    # real groups per block
    per_group = tl.where(groups > 0.0, 1.0 / tl.where(groups > 0.0, groups, 1.0), 0.0)
    q_blocks = pid * QB + tl.arange(0, QB)
    part_sum = part_sum_ptr + h * stride_ph + qg[:, None] * stride_pg
    part_max = part_max_ptr + h * stride_mh + qg * stride_mg
    first, last = _split_tiles(pid, split, splits, n_q, n_k, STRIDE, QG, KG)
    for tile in range(first, last):
        k_blocks = tile * KB + tl.arange(0, KB)
        tile_max = tl.load(part_max + tile)
        weight = tl.where(tile_max == float("-inf"), 0.0, tl.exp2(tile_max - m_safe) * inv_l)
        probs = tl.load(part_sum + k_blocks[None, :]) * weight[:, None]
        sums = tl.sum(tl.reshape(probs, (QB, G, KB)), axis=1)
        tl.store(scores_ptr + h * stride_sh + q_blocks[:, None] * stride_sq + k_blocks[None, :],
                 sums * per_group[:, None],
                 mask=(q_blocks[:, None] < n_qb) & (k_blocks[None, :] < n_kb))


def antidiagonal_scores_triton(q: Tensor, k: Tensor, *, block: int, stride: int, scale: float,
                               key_splits: int | None = None) -> Tensor:
    """See astream.ops.xattention.antidiagonal_scores_ref; block / stride a power of two.
    `key_splits` (a power of two) overrides the splits of each program's key tiles, chosen
    otherwise so that a launch fills the GPU."""
    groups = block // stride
    if block % stride or groups & (groups - 1):
        raise ValueError(f"block {block} / stride {stride} must be a power of two")
    if key_splits is not None and (key_splits < 1 or key_splits & (key_splits - 1)):
        raise ValueError(f"key_splits must be a power of two, got {key_splits}")
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
    programs = triton.cdiv(triton.cdiv(min(rows, n_q), stride), query_groups) * n_heads
    splits = key_splits or fill_splits(programs, tiles, q.device)
    for start in range(0, n_q, rows):
        end = min(n_q, start + rows)
        _launch(q[start:end], k, n_k - (n_q - end), scores[:, start // block:], block, stride,
                scale, query_groups, key_groups, tiles, splits)
    return scores


def fill_splits(programs: int, tiles: int, device: torch.device) -> int:
    """Key splits (a power of two, at most MAX_KEY_SPLITS) that give a launch of `programs`
    query programs at least PROGRAMS_PER_SM programs an SM where it has the key tiles for
    them (a split past a program's own tiles just ends at once)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = triton.cdiv(PROGRAMS_PER_SM * sms, programs)
    return min(triton.next_power_of_2(want), triton.next_power_of_2(tiles), MAX_KEY_SPLITS)


def _launch(q: Tensor, k: Tensor, n_k: int, scores: Tensor, block: int, stride: int, scale: float,
            query_groups: int, key_groups: int, tiles: int, splits: int) -> None:
    """Score q against the first n_k keys (its causal offset is n_k - len(q))."""
    n_q, n_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    key_rows = min(k.shape[0], triton.cdiv(n_k, stride) * stride)
    programs = triton.cdiv(triton.cdiv(n_q, stride), query_groups)
    part_sum = torch.empty(n_heads, programs * query_groups, tiles * (key_groups * stride // block),
                           dtype=torch.float32, device=q.device)
    part_max = torch.empty(n_heads, programs * query_groups, tiles, dtype=torch.float32,
                           device=q.device)
    split_stats = torch.empty(n_heads, programs * query_groups, splits, 2, dtype=torch.float32,
                              device=q.device)
    grid = (programs, n_heads, splits)
    _partial_kernel[grid](
        q, k, part_sum, part_max, split_stats, scale * LOG2E / stride, n_q, n_k, key_rows, splits,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), part_sum.stride(0), part_sum.stride(1),
        part_max.stride(0), part_max.stride(1), split_stats.stride(0), split_stats.stride(1),
        GROUP=n_heads // kv_heads, HEAD_DIM=head_dim,
        D_PAD=max(triton.next_power_of_2(head_dim), MIN_DOT_DIM), STRIDE=stride, BLOCK=block,
        QG=query_groups, KG=key_groups,
        PRECISION="ieee" if k.dtype == torch.float32 else "tf32", num_warps=8, num_stages=2,
    )
    _finish_kernel[grid](
        scores, part_sum, part_max, split_stats, n_q, n_k, triton.cdiv(n_q, block),
        triton.cdiv(n_k, block), splits, scores.stride(0), scores.stride(1), part_sum.stride(0),
        part_sum.stride(1), part_max.stride(0), part_max.stride(1), split_stats.stride(0),
        split_stats.stride(1), STRIDE=stride, BLOCK=block, QG=query_groups, KG=key_groups,
        num_warps=4,
    )
