"""Triton building blocks shared by the attention kernels (decode, Quest's selected pages,
MInference, XAttention): masks, the score and value products, one online-softmax step,
K/V tile loads and their fp8 dequantization, query tiles and split results.

Scores run in base 2 (exp2 is the native SFU op; log2(e) is folded into the scale), and
`_finish` turns the running (max, sum, acc) into (out, natural-log lse).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

LOG2E = math.log2(math.e)
LN2 = tl.constexpr(math.log(2.0))  # constexpr so the kernels may read it
MIN_DOT_DIM = 16  # tl.dot needs M, N, K >= 16: the query group is padded with masked rows
NUM_WARPS = 4
NUM_STAGES = 2


@triton.jit
def _dim_mask(row_ok, dims, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    # A [R, 1] mask keeps power-of-two head dims free of a per-column mask (full-width loads).
    if HEAD_DIM == D_PAD:
        mask = row_ok[:, None]
    else:
        mask = row_ok[:, None] & (dims[None, :] < HEAD_DIM)
    return mask


@triton.jit
def _scores(q, k, USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """q [GP, D] x k [N, D] -> [GP, N] float32."""
    if USE_DOT:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    else:
        s = tl.sum(q[:, None, :].to(tl.float32) * k[None, :, :].to(tl.float32), axis=2)
    return s


@triton.jit
def _weighted_values(p, v, USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """p [GP, N] float32 x v [N, D] -> [GP, D] float32."""
    if USE_DOT:
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    else:
        pv = tl.sum(p[:, :, None] * v[None, :, :].to(tl.float32), axis=1)
    return pv


@triton.jit
def _split_range(lens_ptr, b, split, num_splits, BLOCK_N: tl.constexpr):
    # Slices are even shares of this sequence's own length (rounded up to whole tiles).
    ctx = tl.load(lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, ctx)
    return lo, hi


@triton.jit
def _token_slots(tables_row, toks, tok_ok, PAGE: tl.constexpr):
    """Physical (block, slot) of each logical token position."""
    # int64: block_id * stride_blk overflows int32 on caches above 2**31 elements.
    blk = tl.load(tables_row + toks // PAGE, mask=tok_ok, other=0).to(tl.int64)
    return blk, toks % PAGE


@triton.jit
def _attend_tile(q, k, v, tok_ok, m_i, l_i, acc, scale_log2,
                 USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax step over a K/V tile; returns the updated (m, l, acc)."""
    # exp2 is the native SFU op; log2(e) is folded into scale_log2 so scores are in base 2.
    s = _scores(q, k, USE_DOT, PRECISION) * scale_log2
    s = tl.where(tok_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_new = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _weighted_values(p, v, USE_DOT, PRECISION)
    return m_new, l_new, acc


@triton.jit
def _load_kv(k_ptr, v_ptr, blk, slot, kvh, dims, tok_mask, stride_kb, stride_kt, stride_kh,
             stride_vb, stride_vt, stride_vh):
    """K and V tiles [N, D_PAD] of one KV head at physical (block, slot) positions."""
    k_off = blk * stride_kb + slot * stride_kt + kvh * stride_kh
    v_off = blk * stride_vb + slot * stride_vt + kvh * stride_vh
    k = tl.load(k_ptr + k_off[:, None] + dims[None, :], mask=tok_mask, other=0.0)
    v = tl.load(v_ptr + v_off[:, None] + dims[None, :], mask=tok_mask, other=0.0)
    return k, v


@triton.jit
def _to_compute(k, v, q, KV_CAST: tl.constexpr):
    """8-bit K/V tiles in the query's dtype (exact: every fp8 value is a bf16/fp16 value)."""
    if KV_CAST:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    return k, v


@triton.jit
def _head_scales(k_scale_ptr, v_scale_ptr, kvh, HAS_SCALES: tl.constexpr):
    """This KV head's dequantization scales (1 for an unscaled cache)."""
    if HAS_SCALES:
        ks = tl.load(k_scale_ptr + kvh)
        vs = tl.load(v_scale_ptr + kvh)
    else:
        ks = tl.full([], 1.0, tl.float32)
        vs = tl.full([], 1.0, tl.float32)
    return ks, vs


@triton.jit
def _query_tile(q_ptr, b, heads, dims, row_mask, stride_qb, stride_qh, cache_ty,
                KV_CAST: tl.constexpr):
    """A query-head group [GROUP_PAD, D_PAD], in the cache's dtype unless K/V are cast to it."""
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=row_mask, other=0.0)
    if not KV_CAST:
        q = q.to(cache_ty)
    return q


@triton.jit
def _store_split(out_ptr, lse_ptr, out, lse, b, split, heads, rows, dims, row_mask,
                 stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_ls,
                 GROUP: tl.constexpr):
    """One split's (out, lse) of a query-head group."""
    o_base = out_ptr + b * stride_ob + split * stride_os
    tl.store(o_base + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask)
    tl.store(lse_ptr + b * stride_lb + split * stride_ls + heads * stride_lh, lse,
             mask=rows < GROUP)


@triton.jit
def _finish(m_i, l_i, acc):
    """(out, natural-log lse); a split that saw no key gives (0, -inf), never NaN."""
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    return acc / l_safe[:, None], lse
