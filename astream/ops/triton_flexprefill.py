"""Triton kernels for FlexPrefill's last-block estimate (CUDA; also runs under
TRITON_INTERPRET=1): each query head's mean attention weight per key block (vertical) and
per diagonal block (slash), from the chunk's last rows, without forming their weights.
Reference and contract: astream.ops.flexprefill.last_block_sums_ref.

The softmax needs every key's score before any weight, so the rows' scores are formed twice:
- `_stats_kernel`, grid (head, key-tile group): each program walks TILES key tiles of
  `block` keys and keeps its rows' running max and sum (base 2); torch combines the groups
  into each row's max and sum ([H, rows], a few kilobytes).
- `_sums_kernel`, grid (head, key block): the block's weights, summed over its keys and
  rows (vertical), and over the entries of each diagonal block they fall on. Row r (position
  p) meets key c of block b at distance p - c; across the last `block` rows and one key block
  the distances span less than two blocks, so they fall on three consecutive diagonal
  blocks at most, d0(b) + 0, 1, 2, with d0(b) = d0(0) - b. Each program writes its three
  sums; torch adds them into the diagonal blocks (deterministic, no atomics).

Programs are ordered head-fastest, so the heads reading one key tile run together and the
tile is read from L2 once for the group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from astream.ops.triton_tiles import LOG2E, MIN_DOT_DIM, _dim_mask

TILES = 8                # key tiles a stats program walks


@triton.jit
def _row_scores(q_ptr, k_ptr, h, kvh, rows, row_ok, position, tile, scale_log2, n_k,
                stride_qt, stride_qh, stride_kt, stride_kh, HEAD_DIM: tl.constexpr,
                D_PAD: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    """[R, BLOCK] base-2 scores of the rows against key tile `tile`; -inf where not visible."""
    dims = tl.arange(0, D_PAD)
    keys = tile * BLOCK + tl.arange(0, BLOCK)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + dims[None, :],
                mask=_dim_mask(row_ok, dims, HEAD_DIM, D_PAD), other=0.0)
    k = tl.load(k_ptr + keys[:, None] * stride_kt + kvh * stride_kh + dims[None, :],
                mask=_dim_mask(keys < n_k, dims, HEAD_DIM, D_PAD), other=0.0)
    s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=PRECISION) * scale_log2
    visible = row_ok[:, None] & (keys[None, :] <= position[:, None])
    return tl.where(visible, s, float("-inf"))


# The key count changes with every chunk: specializing on it would compile again mid-serving.
@triton.jit(do_not_specialize=["n_rows", "n_k", "n_kb", "stride_sh", "stride_sg"])
def _stats_kernel(q_ptr, k_ptr, stats_ptr, scale_log2, n_rows, n_k, n_kb,
                  stride_qt, stride_qh, stride_kt, stride_kh, stride_sh, stride_sg,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                  BLOCK: tl.constexpr, R_PAD: tl.constexpr, TILES_PER: tl.constexpr,
                  PRECISION: tl.constexpr):
    h = tl.program_id(0)
    part = tl.program_id(1)
    rows = tl.arange(0, R_PAD)
    row_ok = rows < n_rows
    position = n_k - n_rows + rows
    m_i = tl.full([R_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([R_PAD], tl.float32)
    for tile in range(part * TILES_PER, tl.minimum(part * TILES_PER + TILES_PER, n_kb)):
        s = _row_scores(q_ptr, k_ptr, h, h // GROUP, rows, row_ok, position, tile, scale_log2,
                        n_k, stride_qt, stride_qh, stride_kt, stride_kh, HEAD_DIM, D_PAD, BLOCK,
                        PRECISION)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), axis=1)
        m_i = m_new
    out = stats_ptr + h * stride_sh + part * stride_sg + rows * 2
    tl.store(out, m_i)
    tl.store(out + 1, l_i)


@triton.jit(do_not_specialize=["n_rows", "n_k", "first_diagonal", "stride_rh", "stride_ph",
                               "stride_pb"])
def _sums_kernel(q_ptr, k_ptr, row_stats_ptr, vertical_ptr, parts_ptr, scale_log2, n_rows, n_k,
                 first_diagonal, stride_qt, stride_qh, stride_kt, stride_kh, stride_rh,
                 stride_vh, stride_ph, stride_pb,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                 BLOCK: tl.constexpr, R_PAD: tl.constexpr, PRECISION: tl.constexpr):
    h = tl.program_id(0)
    b = tl.program_id(1)
    rows = tl.arange(0, R_PAD)
    row_ok = rows < n_rows
    position = n_k - n_rows + rows
    s = _row_scores(q_ptr, k_ptr, h, h // GROUP, rows, row_ok, position, b, scale_log2, n_k,
                    stride_qt, stride_qh, stride_kt, stride_kh, HEAD_DIM, D_PAD, BLOCK, PRECISION)
    m = tl.load(row_stats_ptr + h * stride_rh + rows * 2, mask=row_ok, other=0.0)
    inv_l = 1.0 / tl.load(row_stats_ptr + h * stride_rh + rows * 2 + 1, mask=row_ok, other=1.0)
    p = tl.exp2(s - m[:, None]) * inv_l[:, None]          # 0 where not visible (exp2(-inf))
    tl.store(vertical_ptr + h * stride_vh + b, tl.sum(tl.sum(p, axis=1), axis=0))
    keys = b * BLOCK + tl.arange(0, BLOCK)
    diagonal = (position[:, None] - keys[None, :] + BLOCK * 4) // BLOCK - 4  # floor for < 0
    relative = diagonal - (first_diagonal - b)
    out = parts_ptr + h * stride_ph + b * stride_pb
    for i in tl.static_range(3):
        tl.store(out + i, tl.sum(tl.sum(tl.where(relative == i, p, 0.0), axis=1), axis=0))


def last_block_sums_triton(rows: Tensor, k: Tensor, *, block: int, scale: float) -> tuple[Tensor, Tensor]:
    """(vertical, slash) [H, n_kb] float32 of last_block_sums_ref for the chunk's last rows
    `rows` [R, H, D] (R <= block; the last at position len(k) - 1) against k [Tk, KVH, D]."""
    n_rows, n_heads, head_dim = rows.shape
    n_k, kv_heads, _ = k.shape
    if block & (block - 1) or block < MIN_DOT_DIM or n_rows > block:
        raise ValueError(f"block {block} must be a power of two >= {MIN_DOT_DIM} and hold the "
                         f"{n_rows} rows")
    rows, k = (x if x.stride(-1) == 1 else x.contiguous() for x in (rows, k))
    n_kb = triton.cdiv(n_k, block)
    parts = triton.cdiv(n_kb, TILES)
    r_pad = max(triton.next_power_of_2(n_rows), MIN_DOT_DIM)
    common = dict(GROUP=n_heads // kv_heads, HEAD_DIM=head_dim,
                  D_PAD=max(triton.next_power_of_2(head_dim), MIN_DOT_DIM), BLOCK=block, R_PAD=r_pad,
                  PRECISION="ieee" if k.dtype == torch.float32 else "tf32", num_warps=8)
    scale_log2 = scale * LOG2E
    stats = torch.empty(n_heads, parts, r_pad, 2, dtype=torch.float32, device=k.device)
    _stats_kernel[(n_heads, parts)](
        rows, k, stats, scale_log2, n_rows, n_k, n_kb, rows.stride(0), rows.stride(1),
        k.stride(0), k.stride(1), stats.stride(0), stats.stride(1), TILES_PER=TILES, **common)
    row_max = stats[..., 0].amax(1)                                           # [H, R_PAD]
    safe = torch.where(torch.isinf(row_max), 0.0, row_max)
    row_sum = (stats[..., 1] * torch.exp2(stats[..., 0] - safe.unsqueeze(1))).sum(1)
    row_stats = torch.stack((safe, row_sum), dim=-1).contiguous()             # [H, R_PAD, 2]
    vertical = torch.empty(n_heads, n_kb, dtype=torch.float32, device=k.device)
    diag_parts = torch.empty(n_heads, n_kb, 3, dtype=torch.float32, device=k.device)
    # Block 0's lowest diagonal: its nearest key (block - 1) from the first row.
    first_diagonal = (n_k - n_rows - block + 1) // block
    _sums_kernel[(n_heads, n_kb)](
        rows, k, row_stats, vertical, diag_parts, scale_log2, n_rows, n_k, first_diagonal,
        rows.stride(0), rows.stride(1), k.stride(0), k.stride(1), row_stats.stride(0),
        vertical.stride(0), diag_parts.stride(0), diag_parts.stride(1), **common)
    # Key block b's part i is diagonal block first_diagonal - b + i.
    blocks = torch.arange(n_kb, device=k.device)
    slash = torch.zeros_like(vertical)
    for i in range(3):
        source = first_diagonal + i - blocks          # the key block feeding diagonal d
        ok = (source >= 0) & (source < n_kb)
        slash += torch.where(ok, diag_parts[:, source.clamp(0, n_kb - 1), i], 0.0)
    return vertical / n_rows, slash / n_rows
