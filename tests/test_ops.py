"""CPU tests for astream.ops attention: reference vs float64 math, paged decode,
LSE merging, the Triton decode kernel (interpreter mode, in a subprocess) and dispatch."""

from __future__ import annotations

import math

import pytest
import torch
from triton_interpreter import run_interpreted_check

from astream.ops import attention_ref, flash
from astream.ops.attention import (
    VarlenMeta,
    merge_attention,
    merge_into_rows_ref,
    paged_decode_attention,
    select_backend,
    select_decode_backend,
    varlen_attention,
    varlen_backend_for,
)

KV_HEADS = 2


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
        out, lse = paged_decode_attention(q, k_cache, v_cache, tables, lens,
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
    out, lse = paged_decode_attention(q, k_cache, v_cache, tables, lens,
                                      scale=0.2, max_context_len=33)
    torch.testing.assert_close(out, exp_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, exp_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_paged_decode_reference_over_fp8_equals_dequantize_then_attend(kv_dtype):
    q, _, _, k_cache, v_cache, tables, lens = paged_case([0, 19, 64, 90], KV_HEADS * 2, 64)
    gen = torch.Generator().manual_seed(5)
    (kq, ks), (vq, vs) = fp8_cache(k_cache, kv_dtype, gen), fp8_cache(v_cache, kv_dtype, gen)
    kw = dict(scale=0.125, max_context_len=90)
    out, lse = paged_decode_attention(q, kq, vq, tables, lens, kv_scales=(ks, vs), **kw)
    dequant_k = kq.float() * ks.view(1, 1, -1, 1)
    dequant_v = vq.float() * vs.view(1, 1, -1, 1)
    want_out, want_lse = paged_decode_attention(q, dequant_k, dequant_v, tables, lens, **kw)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    # and the fp8 error itself stays within the format's precision of the exact result
    exact_out, _ = paged_decode_attention(q, k_cache, v_cache, tables, lens, **kw)
    rel = (out - exact_out).norm() / exact_out.norm()
    assert rel < (0.05 if kv_dtype == torch.float8_e4m3fn else 0.1), float(rel)


def test_paged_decode_all_empty():
    q, _, _, k_cache, v_cache, tables, _ = paged_case([3, 4], KV_HEADS, 64)
    lens = torch.zeros(2, dtype=torch.int32)
    out, lse = paged_decode_attention(q, k_cache, v_cache, tables, lens,
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


f32, f16 = torch.float32, torch.float16
TRITON_CASES = [  # (context lens, gqa ratio, head_dim, page, num_splits, use_dot, dtype)
    ([0, 1, 17, 70], 1, 64, 16, None, None, f32),
    ([0, 1, 17, 70], 4, 64, 16, 1, None, f32),
    ([0, 1, 17, 70], 4, 64, 16, 3, None, f32),
    ([33, 100, 0], 3, 32, 8, 5, True, f32),
    ([33, 100, 0], 3, 32, 8, 2, False, f32),
    ([129, 64], 8, 128, 16, 2, None, f32),
    ([40, 7], 2, 48, 16, 2, None, f32),
    ([0, 90, 17], 4, 64, 16, 2, None, f16),  # 16-bit caches
    ([5, 30], 2, 8, 4, 2, None, f32),  # head_dim < 16: broadcast-reduce fallback
]


FP8_CASES = [  # (context lens, gqa ratio, head_dim, page, num_splits, query dtype, cache dtype)
    ([0, 90, 17], 4, 64, 16, 2, torch.float16, torch.float8_e4m3fn),
    ([33, 129], 2, 128, 16, 1, torch.float16, torch.float8_e5m2),
    ([70, 5], 8, 64, 16, 3, torch.float32, torch.float8_e4m3fn),
]


def fp8_cache(cache: torch.Tensor, dtype: torch.dtype, gen: torch.Generator):
    """A cache stored as `dtype` with per-KV-head scales that put each head's largest
    magnitude at a random 1/2..1 of the format's range: (stored, scales)."""
    top = torch.finfo(dtype).max
    peak = cache.abs().amax(dim=(0, 1, 3))
    scales = peak * (1 + torch.rand(cache.shape[2], generator=gen)) / top
    return (cache / scales.view(1, 1, -1, 1)).clamp(-top, top).to(dtype), scales


def check_triton_fp8(device: str, tol: float) -> int:
    """fp8 caches with per-head scales: the kernel against the reference on the same tensors."""
    from astream.ops.triton_decode import paged_decode_triton
    for i, (lens, ratio, dim, page, splits, q_dtype, kv_dtype) in enumerate(FP8_CASES):
        q, _, _, kc, vc, tables, ctx = paged_case(lens, 2 * ratio, dim, page=page, seed=30 + i)
        gen = torch.Generator().manual_seed(i)
        (kc, ks), (vc, vs) = fp8_cache(kc * 20, kv_dtype, gen), fp8_cache(vc, kv_dtype, gen)
        q, kc, vc, tables, ctx, ks, vs = (t.to(device) for t in (q.to(q_dtype), kc, vc, tables,
                                                                 ctx, ks, vs))
        kw = dict(scale=dim ** -0.5, max_context_len=max(lens), kv_scales=(ks, vs))
        out, lse = paged_decode_triton(q, kc, vc, tables, ctx, num_splits=splits, **kw)
        ref_out, ref_lse = attention_ref.paged_decode_attention_ref(q.float(), kc, vc, tables, ctx, **kw)
        assert out.dtype == q_dtype
        torch.testing.assert_close(out.float(), ref_out, atol=tol, rtol=tol)
        torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)
    return len(FP8_CASES)


def check_triton_cases(device: str, tol_f32: float, tol_f16: float) -> int:
    """Run every TRITON_CASES entry through the Triton kernel and the reference; returns the count."""
    from astream.ops.triton_decode import paged_decode_triton
    for i, (lens, ratio, dim, page, splits, use_dot, dtype) in enumerate(TRITON_CASES):
        q, _, _, kc, vc, tables, ctx = paged_case(lens, 2 * ratio, dim, page=page, seed=10 + i)
        q, kc, vc, tables, ctx = (t.to(device) for t in (q, kc, vc, tables, ctx))
        q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
        kw = dict(scale=dim ** -0.5, max_context_len=max(lens))
        out, lse = paged_decode_triton(q, kc, vc, tables, ctx, num_splits=splits,
                                       use_dot=use_dot, **kw)
        ref_out, ref_lse = attention_ref.paged_decode_attention_ref(q.float(), kc, vc, tables, ctx, **kw)
        tol = tol_f32 if dtype == f32 else tol_f16
        assert out.dtype == dtype and lse.dtype == f32
        torch.testing.assert_close(out.float(), ref_out, atol=tol, rtol=tol)
        torch.testing.assert_close(lse, ref_lse, atol=tol_f32, rtol=tol_f32)
    return len(TRITON_CASES) + check_triton_merge(device, tol_f16) + check_triton_fp8(device, tol_f16)


def merge_case(seed: int, dtype: torch.dtype, dim: int = 64):
    """Partial results of 6 rows and of 3 of them, with empty sides (lse -inf) on both."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.randn(6, 4, dim, generator=gen).to(dtype)
    lse = torch.randn(6, 4, generator=gen) * 3
    part_out = torch.randn(3, 4, dim, generator=gen).to(dtype)
    part_lse = torch.randn(3, 4, generator=gen) * 3
    lse[1, 0] = part_lse[0, 1] = lse[4, 2] = -math.inf
    part_lse[2, 2] = -math.inf                      # row 4, head 2: both sides empty
    return out, lse, torch.tensor([1, 5, 4]), part_out, part_lse


def check_triton_merge(device: str, tol: float) -> int:
    from astream.ops.triton_merge import merge_into_rows_triton
    for seed, dtype, dim in ((0, torch.float32, 64), (1, torch.float16, 48)):
        args = [t.to(device) for t in merge_case(seed, dtype, dim)]
        want = merge_into_rows_ref(*(t.clone() for t in args))
        got = merge_into_rows_triton(*args)
        assert got[0] is args[0]                     # in place
        torch.testing.assert_close(got[0].float(), want[0].float(), atol=tol, rtol=tol)
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    return 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the compiled kernel is tested")
def test_triton_decode_interpreter_matches_reference():
    assert run_interpreted_check("test_ops", "check_triton_cases", 1e-4, 2e-3) == \
        len(TRITON_CASES) + 1 + len(FP8_CASES)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_decode_on_gpu_matches_reference():
    # Compiled kernels may use TF32 dots on float32 inputs: looser than the interpreter.
    assert check_triton_cases("cuda", tol_f32=5e-3, tol_f16=5e-3) == \
        len(TRITON_CASES) + 1 + len(FP8_CASES)


def test_merge_into_rows_reference_merges_only_those_rows():
    out, lse, rows, part_out, part_lse = merge_case(2, torch.float32)
    got_out, got_lse = merge_into_rows_ref(out, lse, rows, part_out, part_lse)
    for i, row in enumerate(rows.tolist()):
        want = merge_attention(out[row], lse[row], part_out[i], part_lse[i])
        torch.testing.assert_close(got_out[row], want[0])
        torch.testing.assert_close(got_lse[row], want[1])
    untouched = [r for r in range(6) if r not in rows.tolist()]
    assert torch.equal(got_out[untouched], out[untouched])
    assert torch.isneginf(got_lse[4, 2]) and torch.all(got_out[4, 2] == 0)


def test_num_splits_rule():
    pytest.importorskip("triton")
    from astream.ops.triton_decode import MAX_SPLITS, choose_num_splits

    cpu = torch.device("cpu")
    assert choose_num_splits(8, 8, 1, cpu) == 1
    assert choose_num_splits(1, 8, 300, cpu) == 3
    assert choose_num_splits(1, 8, 10**6, cpu) <= MAX_SPLITS
    assert choose_num_splits(128, 8, 10**6, cpu) == 1  # 1024 programs already fill the GPU


@pytest.mark.parametrize("max_batch", [1, 3, 8, 20, 64, 256])
def test_every_decode_batch_size_has_a_captured_graph(max_batch):
    from astream.executor.cuda_graphs import capture_sizes
    sizes = capture_sizes(max_batch)
    assert all(any(s >= n for s in sizes) for n in range(1, max_batch + 1))
    assert max(sizes) == max_batch and sizes == sorted(set(sizes))
