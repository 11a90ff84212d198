"""The Triton paged-decode kernel and its split merge against the torch references (in the
interpreter on the CPU, in a subprocess; compiled on CUDA), fp8 caches included, and the
split-count rule."""

from __future__ import annotations

import math

import pytest
import torch
from test_ops import fp8_cache, paged_case
from triton_interpreter import run_interpreted_check

from astream.ops import attention_ref
from astream.ops.attention import merge_attention, merge_into_rows_ref

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
    assert run_interpreted_check("test_triton_decode", "check_triton_cases", 1e-4, 2e-3) == \
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
