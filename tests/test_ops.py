"""CPU tests for astream.ops attention: reference vs float64 math, paged decode,
LSE merging and dispatch. The Triton decode kernel against these: test_triton_decode."""

from __future__ import annotations

import math

import pytest
import torch

from astream.ops import attention_ref, flash
from astream.ops.attention import (
    VarlenMeta,
    merge_attention,
    select_backend,
    select_decode_backend,
    varlen_attention,
    varlen_backend_for,
)
from astream.ops.backends import AttentionBackends

KV_HEADS = 2
# Paged decode as an engine on this CPU runs it: the torch reference.
REFERENCE = AttentionBackends.select(torch.device("cpu"), torch.float32, 64)


def make_meta(lens_q: list[int], lens_k: list[int]) -> VarlenMeta:
    cu_q = [0]
    cu_k = [0]
    for lq, lk in zip(lens_q, lens_k):
        cu_q.append(cu_q[-1] + lq)
        cu_k.append(cu_k[-1] + lk)
    return VarlenMeta(
        cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32),
        max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
        host_cu_seqlens_q=cu_q, host_cu_seqlens_k=cu_k,
    )


def naive_attention(q, k, v, causal: bool, scale: float):
    """One sequence in float64 with an explicit (bottom-right) causal mask matrix."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal:
        n_q, n_k = q.shape[0], k.shape[0]
        allowed = torch.ones(n_q, n_k, dtype=torch.bool).tril(diagonal=n_k - n_q)
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
    return out, lse.t()


def naive_varlen(q, k, v, meta: VarlenMeta, causal: bool, scale: float):
    outs, lses = [], []
    cq, ck = meta.host_cu_seqlens_q, meta.host_cu_seqlens_k
    for s in range(len(cq) - 1):
        o, l = naive_attention(q[cq[s]:cq[s + 1]], k[ck[s]:ck[s + 1]], v[ck[s]:ck[s + 1]],
                               causal, scale)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


def random_qkv(lens_q, lens_k, heads, head_dim, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(sum(lens_k), KV_HEADS, head_dim, generator=gen).to(dtype)
    v = torch.randn(sum(lens_k), KV_HEADS, head_dim, generator=gen).to(dtype)
    return q, k, v


# len_q < len_k exercises bottom-right alignment; length-1 sequences included.
LENS_Q = [1, 7, 33, 5, 1]
LENS_K = [1, 7, 50, 12, 9]


@pytest.mark.parametrize("ratio", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_reference_matches_float64(ratio, head_dim, causal):
    q, k, v = random_qkv(LENS_Q, LENS_K, KV_HEADS * ratio, head_dim)
    meta = make_meta(LENS_Q, LENS_K)
    scale = head_dim ** -0.5
    out, lse = varlen_attention(q, k, v, meta, causal=causal, scale=scale)
    ref_out, ref_lse = naive_varlen(q, k, v, meta, causal, scale)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)


def test_varlen_reference_chunked_rows(monkeypatch):
    """Tiny score budget forces query-row chunking (and causal key trimming per chunk)."""
    monkeypatch.setattr(attention_ref, "MAX_SCORE_ELEMENTS", 300)
    lens_q, lens_k = [40, 3], [64, 3]
    q, k, v = random_qkv(lens_q, lens_k, KV_HEADS * 2, 64, seed=1)
    meta = make_meta(lens_q, lens_k)
    out, lse = varlen_attention(q, k, v, meta, causal=True, scale=0.125)
    ref_out, ref_lse = naive_varlen(q, k, v, meta, True, 0.125)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)


def test_varlen_reference_bf16_output_dtype():
    q, k, v = random_qkv(LENS_Q, LENS_K, KV_HEADS * 4, 64, dtype=torch.bfloat16, seed=2)
    meta = make_meta(LENS_Q, LENS_K)
    out, lse = varlen_attention(q, k, v, meta, causal=True, scale=0.125)
    ref_out, ref_lse = naive_varlen(q, k, v, meta, True, 0.125)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)


def build_paged_cache(keys, values, page: int, num_blocks: int, seed: int):
    """Scatter per-sequence keys into shuffled cache blocks; unused table slots hold garbage."""
    gen = torch.Generator().manual_seed(seed)
    head_dim = keys[0].shape[-1]
    k_cache = torch.randn(num_blocks, page, KV_HEADS, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, page, KV_HEADS, head_dim, generator=gen)
    max_blocks = max(-(-len(x) // page) for x in keys) + 1
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(keys), max_blocks), 10**6, dtype=torch.int32)
    for b, (kb, vb) in enumerate(zip(keys, values)):
        for i in range(-(-len(kb) // page)):
            blk = free.pop()
            tables[b, i] = blk
            chunk = slice(i * page, min((i + 1) * page, len(kb)))
            k_cache[blk, : chunk.stop - chunk.start] = kb[chunk]
            v_cache[blk, : chunk.stop - chunk.start] = vb[chunk]
    return k_cache, v_cache, tables


def paged_case(ctx_lens, heads, head_dim, page=16, seed=3):
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, KV_HEADS, head_dim, generator=gen) for n in ctx_lens]
    values = [torch.randn(n, KV_HEADS, head_dim, generator=gen) for n in ctx_lens]
    q = torch.randn(len(ctx_lens), heads, head_dim, generator=gen)
    k_cache, v_cache, tables = build_paged_cache(keys, values, page, 64, seed)
    lens = torch.tensor(ctx_lens, dtype=torch.int32)
    return q, keys, values, k_cache, v_cache, tables, lens


@pytest.mark.parametrize("ratio", [1, 4])
def test_paged_decode_reference_matches_varlen(ratio):
    ctx_lens = [0, 1, 16, 17, 45, 100]  # empty, one key, full block, mid-block ends
    q, keys, values, k_cache, v_cache, tables, lens = paged_case(ctx_lens, KV_HEADS * ratio, 64)
    meta = make_meta([1] * len(ctx_lens), ctx_lens)
    exp_out, exp_lse = attention_ref.varlen_attention_ref(
        q, torch.cat(keys), torch.cat(values), meta, causal=True, scale=0.125)
    for max_ctx in (100, 128):  # an upper bound above the longest context is fine too
        out, lse = REFERENCE.paged_decode(q, k_cache, v_cache, tables, lens,
                                          scale=0.125, max_context_len=max_ctx)
        torch.testing.assert_close(out, exp_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, exp_lse, atol=1e-5, rtol=1e-5)
    assert torch.all(out[0] == 0) and torch.all(torch.isneginf(lse[0]))


def test_paged_decode_reference_batch_chunks(monkeypatch):
    monkeypatch.setattr(attention_ref, "MAX_SCORE_ELEMENTS", 1)
    q, keys, values, k_cache, v_cache, tables, lens = paged_case([5, 33, 0], KV_HEADS * 2, 64)
    meta = make_meta([1, 1, 1], [5, 33, 0])
    exp_out, exp_lse = attention_ref.varlen_attention_ref(
        q, torch.cat(keys), torch.cat(values), meta, causal=False, scale=0.2)
    out, lse = REFERENCE.paged_decode(q, k_cache, v_cache, tables, lens,
                                      scale=0.2, max_context_len=33)
    torch.testing.assert_close(out, exp_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, exp_lse, atol=1e-5, rtol=1e-5)


def fp8_cache(cache: torch.Tensor, dtype: torch.dtype, gen: torch.Generator):
    """A cache stored as `dtype` with per-KV-head scales that put each head's largest
    magnitude at a random 1/2..1 of the format's range: (stored, scales)."""
    top = torch.finfo(dtype).max
    peak = cache.abs().amax(dim=(0, 1, 3))
    scales = peak * (1 + torch.rand(cache.shape[2], generator=gen)) / top
    return (cache / scales.view(1, 1, -1, 1)).clamp(-top, top).to(dtype), scales


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_paged_decode_reference_over_fp8_equals_dequantize_then_attend(kv_dtype):
    q, _, _, k_cache, v_cache, tables, lens = paged_case([0, 19, 64, 90], KV_HEADS * 2, 64)
    gen = torch.Generator().manual_seed(5)
    (kq, ks), (vq, vs) = fp8_cache(k_cache, kv_dtype, gen), fp8_cache(v_cache, kv_dtype, gen)
    kw = dict(scale=0.125, max_context_len=90)
    out, lse = REFERENCE.paged_decode(q, kq, vq, tables, lens, kv_scales=(ks, vs), **kw)
    dequant_k = kq.float() * ks.view(1, 1, -1, 1)
    dequant_v = vq.float() * vs.view(1, 1, -1, 1)
    want_out, want_lse = REFERENCE.paged_decode(q, dequant_k, dequant_v, tables, lens, **kw)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    # and the fp8 error itself stays within the format's precision of the exact result
    exact_out, _ = REFERENCE.paged_decode(q, k_cache, v_cache, tables, lens, **kw)
    rel = (out - exact_out).norm() / exact_out.norm()
    assert rel < (0.05 if kv_dtype == torch.float8_e4m3fn else 0.1), float(rel)


def test_paged_decode_all_empty():
    q, _, _, k_cache, v_cache, tables, _ = paged_case([3, 4], KV_HEADS, 64)
    lens = torch.zeros(2, dtype=torch.int32)
    out, lse = REFERENCE.paged_decode(q, k_cache, v_cache, tables, lens,
                                      scale=0.125, max_context_len=0)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


@pytest.mark.parametrize("cut", [0, 5, 23, 40])
def test_merge_of_key_split_equals_full(cut):
    n_q, n_k, heads, dim = 4, 40, KV_HEADS * 3, 64
    q, k, v = random_qkv([n_q], [n_k], heads, dim, seed=cut)
    full = attention_ref.varlen_attention_ref(q, k, v, make_meta([n_q], [n_k]),
                                              causal=False, scale=0.125)
    part_a = attention_ref.varlen_attention_ref(q, k[:cut], v[:cut], make_meta([n_q], [cut]),
                                                causal=False, scale=0.125)
    part_b = attention_ref.varlen_attention_ref(q, k[cut:], v[cut:],
                                                make_meta([n_q], [n_k - cut]),
                                                causal=False, scale=0.125)
    out, lse = merge_attention(*part_a, *part_b)
    torch.testing.assert_close(out, full[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, full[1], atol=1e-5, rtol=1e-5)


def test_merge_both_empty_is_empty_not_nan():
    out_a = torch.zeros(3, 4, 8, dtype=torch.bfloat16)
    lse_a = torch.full((3, 4), float("-inf"))
    out, lse = merge_attention(out_a, lse_a, out_a.clone(), lse_a.clone())
    assert out.dtype == torch.bfloat16
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


def test_dispatch_cpu_is_reference():
    assert select_backend(torch.device("cpu")) == "reference"
    assert select_backend("cpu") == "reference"
    assert varlen_backend_for(torch.zeros(1, 2, 64, dtype=torch.bfloat16)) == "reference"
    assert select_decode_backend("cpu") == "reference"
    assert not flash.flash_attn_available(torch.device("cpu"))
    assert not flash.torch_flash_available(torch.device("cpu"))


def test_flash_lse_layout_fix():
    """FA2 writes lse [H, T] with +inf for rows without keys; we expose [T, H] with -inf."""
    lse_ht = torch.tensor([[0.5, math.inf, 1.0], [2.0, math.inf, -1.0]])
    fixed = flash._empty_rows_to_neginf(lse_ht.clone())
    assert fixed.shape == (3, 2)
    assert torch.isneginf(fixed[1]).all()
    assert fixed[0].tolist() == [0.5, 2.0] and fixed[2].tolist() == [1.0, -1.0]


@pytest.mark.parametrize("max_batch", [1, 3, 8, 20, 64, 256])
def test_every_decode_batch_size_has_a_captured_graph(max_batch):
    from astream.executor.cuda_graphs import capture_sizes
    sizes = capture_sizes(max_batch)
    assert all(any(s >= n for s in sizes) for n in range(1, max_batch + 1))
    assert max(sizes) == max_batch and sizes == sorted(set(sizes))
