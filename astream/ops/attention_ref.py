"""Torch reference attention: the CPU production path and the test oracle.

Everything is computed in float32. GQA is handled by viewing the query heads of
one KV head as extra rows of a batched matmul, so K/V are never copied per head.
Rows that see no key get out = 0 and lse = -inf, which `merge_attention` treats
as an empty partial result.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from astream.ops.varlen import VarlenMeta

# Upper bound on score-matrix elements materialised at once (~256 MB of fp32).
MAX_SCORE_ELEMENTS = 64 * 1024 * 1024
# Bytes of float32 weights a sparse-prefill estimate forms at once: `head_slices`' budget.
ESTIMATE_BYTES = 1 << 30


def head_slices(n_heads: int, group: int, head_bytes: int, budget: int) -> list[tuple[int, int]]:
    """Query-head ranges [h0, h1) whose `head_bytes` each stay within `budget` together:
    whole KV heads' groups where more than one fits, else a divisor of one group (at least
    one head), so every range reads its keys from whole KV heads or from one."""
    fits = max(1, budget // max(1, head_bytes))
    per = group * (fits // group) if fits >= group else max(d for d in range(1, group + 1)
                                                              if group % d == 0 and d <= fits)
    return [(h, min(n_heads, h + per)) for h in range(0, n_heads, per)]


def grouped_scores(rows: Tensor, k: Tensor, h0: int, h1: int, group: int) -> Tensor:
    """rows [L, H, D] float32 (queries) against every key k [Tk, KVH, D], query heads h0..h1
    -> [h1 - h0, L, Tk] float32 raw dot products. The query heads of one KV head are rows
    of one matmul: no key is copied per query head."""
    kv0, kv1 = h0 // group, (h1 - 1) // group + 1
    qh = rows[:, h0:h1].transpose(0, 1).reshape(kv1 - kv0, -1, rows.shape[2])
    kh = k[:, kv0:kv1].float().transpose(0, 1)
    return torch.matmul(qh, kh.transpose(1, 2)).view(h1 - h0, rows.shape[0], k.shape[0])


def _softmax_rows(scores: Tensor) -> tuple[Tensor, Tensor]:
    """Row softmax and lse of float32 scores, in place; fully masked rows give (0, -inf)."""
    lse = torch.logsumexp(scores, dim=-1)
    # A row of all -inf has lse -inf; subtracting 0 instead keeps exp() at 0, not NaN.
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    return scores.sub_(safe.unsqueeze(-1)).exp_(), lse


def masked_attention_ref(q: Tensor, k: Tensor, v: Tensor, head_mask: Callable[[int], Tensor], *,
                         scale: float) -> tuple[Tensor, Tensor]:
    """Attention of q [Tq, H, D] over k/v [Tk, KVH, D] where query head h sees only the keys
    `head_mask(h)` [Tq, Tk] (bool) keeps -> out [Tq, H, D] (q.dtype), lse [Tq, H] float32.
    The oracle of the sparse prefill kernels: one head at a time, to bound memory."""
    n_q, n_heads, dim = q.shape
    group = n_heads // k.shape[1]
    out = torch.empty(n_q, n_heads, dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(n_q, n_heads, dtype=torch.float32, device=q.device)
    for h in range(n_heads):
        scores = (q[:, h].float() @ k[:, h // group].float().T) * scale
        probs, lse[:, h] = _softmax_rows(scores.masked_fill_(~head_mask(h), float("-inf")))
        out[:, h] = (probs @ v[:, h // group].float()).to(q.dtype)
    return out, lse


def _heads_first(x: Tensor) -> Tensor:
    """[..., S, KVH, D] any dtype -> contiguous float32 [..., KVH, S, D].

    One copy does the upcast and the transpose, so both matmuls read contiguous rows
    (a permuted operand made CPU matmuls several times slower).
    """
    out = torch.empty(*x.shape[:-3], x.shape[-2], x.shape[-3], x.shape[-1],
                      dtype=torch.float32, device=x.device)
    return out.copy_(x.transpose(-3, -2))


def _grouped_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """Attention of q [L, H, D] over k/v [KVH, S, D] (float32), mask [L, S] True=visible.

    Returns out [L, H, D] and lse [L, H].
    """
    n_q, n_heads, dim = q.shape
    n_kv = k.shape[0]
    group = n_heads // n_kv
    # [KVH, G*L, D]: query heads h = kvh*G + g share kv head kvh.
    qg = q.permute(1, 0, 2).reshape(n_kv, group * n_q, dim).float()
    scores = torch.matmul(qg, k.transpose(1, 2)).mul_(scale)
    if mask is not None:
        scores = scores.view(n_kv, group, n_q, -1)
        scores.masked_fill_(~mask, float("-inf"))
        scores = scores.view(n_kv, group * n_q, -1)
    probs, lse = _softmax_rows(scores)
    out = torch.matmul(probs, v)
    out = out.view(n_heads, n_q, dim).permute(1, 0, 2)
    return out, lse.view(n_heads, n_q).t()


def _row_chunk(n_heads: int, n_keys: int) -> int:
    return max(1, MAX_SCORE_ELEMENTS // max(1, n_heads * n_keys))


def _sequence_attention(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """One sequence; query rows chunked to bound memory."""
    n_q, n_heads, _ = q.shape
    n_k = k.shape[0]
    k, v = _heads_first(k), _heads_first(v)
    offset = n_k - n_q  # bottom-right causal alignment
    outs, lses = [], []
    step = _row_chunk(n_heads, n_k)
    for start in range(0, n_q, step):
        stop = min(start + step, n_q)
        keys_end = n_k if not causal else max(0, min(n_k, stop + offset))
        mask = None
        if causal:
            rows = torch.arange(start, stop, device=q.device).unsqueeze(1) + offset
            mask = torch.arange(keys_end, device=q.device).unsqueeze(0) <= rows
        out, lse = _grouped_attention(
            q[start:stop], k[:, :keys_end], v[:, :keys_end], mask, scale
        )
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def varlen_attention_ref(
    q: Tensor, k: Tensor, v: Tensor, meta: VarlenMeta, *, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """Packed variable-length attention; see `astream.ops.attention.varlen_attention`."""
    n_tokens, n_heads, dim = q.shape
    out = torch.zeros(n_tokens, n_heads, dim, dtype=q.dtype, device=q.device)
    lse = torch.full((n_tokens, n_heads), float("-inf"), dtype=torch.float32, device=q.device)
    cq, ck = meta.host_cu_seqlens_q, meta.host_cu_seqlens_k
    for seq in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[seq], cq[seq + 1], ck[seq], ck[seq + 1]
        if q1 == q0 or k1 == k0:
            continue  # no queries, or no keys: out stays 0, lse stays -inf
        o, s = _sequence_attention(q[q0:q1], k[k0:k1], v[k0:k1], causal, scale)
        out[q0:q1] = o.to(q.dtype)
        lse[q0:q1] = s
    return out, lse


def _gather_context(cache: Tensor, tables: Tensor) -> Tensor:
    """[num_blocks, bs, KVH, D] gathered by tables [B, n] -> [B, KVH, n*bs, D] float32."""
    n_batch, n_blocks = tables.shape
    gathered = cache[tables.reshape(-1)]
    return _heads_first(gathered.reshape(n_batch, n_blocks * cache.shape[1], *cache.shape[2:]))


def scale_heads(x: Tensor, head_scale: Tensor | None) -> Tensor:
    """x [B, KVH, N, D] float32 times a per-KV-head scale [KVH] (in place), if there is one."""
    return x if head_scale is None else x.mul_(head_scale.view(1, -1, 1, 1))


def _decode_chunk(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, lens: Tensor, scale: float,
    kv_scales: tuple[Tensor, Tensor] | None,
) -> tuple[Tensor, Tensor]:
    """Decode for a slice of the batch; tables already clamped to valid block ids."""
    n_batch, n_heads, dim = q.shape
    n_kv = k_cache.shape[2]
    k_scale, v_scale = kv_scales or (None, None)
    keys = scale_heads(_gather_context(k_cache, tables), k_scale)  # [B, KVH, L, D]
    values = scale_heads(_gather_context(v_cache, tables), v_scale)
    qg = q.float().view(n_batch, n_kv, n_heads // n_kv, dim)
    scores = torch.matmul(qg, keys.transpose(2, 3)).mul_(scale)  # [B, KVH, G, L]
    positions = torch.arange(keys.shape[2], device=q.device)
    hidden = positions.view(1, -1) >= lens.view(-1, 1).long()
    scores.masked_fill_(hidden.view(n_batch, 1, 1, -1), float("-inf"))
    values.masked_fill_(hidden.view(n_batch, 1, -1, 1), 0.0)     # past the context: any bytes
    probs, lse = _softmax_rows(scores)
    out = torch.matmul(probs, values)  # [B, KVH, G, D]
    return out.reshape(n_batch, n_heads, dim), lse.reshape(n_batch, n_heads)


def paged_decode_attention_ref(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    *,
    scale: float,
    max_context_len: int,
    kv_scales: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """One query token per sequence over a paged KV cache.

    Gathers ceil(max_context_len / block_size) blocks per sequence, so
    max_context_len must be >= every context_lens entry on this path. With
    kv_scales (k, v: [KVH] float32) the caches hold scaled values (fp8): key = stored *
    k[head], value = stored * v[head].
    """
    n_batch, n_heads, dim = q.shape
    num_blocks, block_size = k_cache.shape[:2]
    n_blocks = min(-(-max_context_len // block_size), block_tables.shape[1])
    out = torch.zeros(n_batch, n_heads, dim, dtype=q.dtype, device=q.device)
    lse = torch.full((n_batch, n_heads), float("-inf"), dtype=torch.float32, device=q.device)
    if n_blocks <= 0 or n_batch == 0:
        return out, lse
    # Entries past a sequence's context may be garbage; clamp so the gather stays in bounds.
    tables = block_tables[:, :n_blocks].long().clamp(0, num_blocks - 1)
    per_row = n_blocks * block_size * max(n_heads, k_cache.shape[2] * dim * 2)
    step = max(1, MAX_SCORE_ELEMENTS // per_row)
    for b0 in range(0, n_batch, step):
        b1 = min(b0 + step, n_batch)
        o, s = _decode_chunk(
            q[b0:b1], k_cache, v_cache, tables[b0:b1], context_lens[b0:b1], scale, kv_scales
        )
        out[b0:b1] = o.to(q.dtype)
        lse[b0:b1] = s
    return out, lse
