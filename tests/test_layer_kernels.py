"""The fused decoder-layer kernels (ops.triton_layer) and the KV write (ops.triton_kv_write)
against their torch references on fresh random inputs: under the Triton interpreter in CI,
compiled on a GPU. The references themselves are checked against plain formulas here."""

from __future__ import annotations

import math

import pytest
import torch
from triton_interpreter import run_interpreted_check

from astream.ops import layer_ref
from astream.ops.kv_write import (
    as_bytes, dequantize_ref, quantize_kv, store_head_major_ref, write_kv, write_kv_ref,
)
from astream.ops.layer_kernels import LayerKernels

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def rope_tables(positions: int, head_dim: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.arange(positions, device=device).float()[:, None] * inv[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def close(got: torch.Tensor, want: torch.Tensor, dtype) -> bool:
    """Equal but for reduction order: a few units in the last place of `dtype`."""
    tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    scale = want.float().abs().max().clamp(min=1.0)
    return bool(((got.float() - want.float()).abs() <= tol * scale).all())


def check_layer_kernels(device: str) -> int:
    from astream.ops import triton_layer

    torch.manual_seed(0)
    cases = 0
    for dtype in (torch.float32, torch.bfloat16):
        for hidden, tokens in ((96, 3), (256, 1)):
            res = torch.randn(tokens, hidden, device=device).to(dtype)
            delta = torch.randn(tokens, hidden, device=device).to(dtype)
            weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
            for d in (None, delta):
                got = triton_layer.add_rms_norm_triton(res, d, weight, 1e-6)
                want = layer_ref.add_rms_norm_ref(res, d, weight, 1e-6)
                assert all(close(g, w, dtype) for g, w in zip(got, want)), (dtype, hidden, d is None)
                cases += 1
            gate_up = (2 * torch.randn(tokens, 2 * hidden, device=device)).to(dtype)
            assert close(triton_layer.silu_mul_triton(gate_up), layer_ref.silu_mul_ref(gate_up), dtype)
            cases += 1
        for heads, kv_heads, head_dim in ((4, 2, 64), (2, 1, 48)):
            cos, sin = rope_tables(64, head_dim, dtype, device)
            positions = torch.tensor([0, 5, 63], device=device)
            qkv = torch.randn(3, (heads + 2 * kv_heads) * head_dim, device=device).to(dtype)
            for norms in (False, True):
                qn = (1 + 0.1 * torch.randn(head_dim, device=device)).to(dtype) if norms else None
                kn = (1 + 0.1 * torch.randn(head_dim, device=device)).to(dtype) if norms else None
                got = triton_layer.qkv_rope_triton(qkv, positions, cos, sin, heads, kv_heads, qn, kn, 1e-6)
                want = layer_ref.qkv_rope_ref(qkv, positions, cos, sin, heads, kv_heads, qn, kn, 1e-6)
                for g, w in zip(got, want):
                    assert g.shape == w.shape and close(g, w, dtype), (dtype, head_dim, norms)
                cases += 1
    return cases


def check_kv_write(device: str) -> int:
    from astream.ops import triton_kv_write

    torch.manual_seed(1)
    cases = 0
    for dtype, compute in ((torch.bfloat16, torch.bfloat16), *((f, torch.bfloat16) for f in FP8)):
        for kv_heads, head_dim in ((2, 64), (3, 40)):
            tokens, slots_total = 5, 16
            qkv = (4 * torch.randn(tokens, 3 * kv_heads * head_dim, device=device)).to(compute)
            k = qkv[:, kv_heads * head_dim: 2 * kv_heads * head_dim].reshape(tokens, kv_heads, head_dim)
            v = qkv[:, 2 * kv_heads * head_dim:].view(tokens, kv_heads, head_dim)     # strided rows
            k = k.contiguous()
            k[0, 0, :3] = 1e6                            # saturates in fp8
            scales = None
            if dtype in FP8:
                scales = (torch.rand(kv_heads, device=device) + 0.01,
                          torch.rand(kv_heads, device=device) + 0.01)
            rows = torch.tensor([7, 0, 15, 3, 9], device=device)
            got = [torch.zeros(slots_total, kv_heads, head_dim, device=device).to(dtype) for _ in range(2)]
            want = [torch.zeros(slots_total, kv_heads, head_dim, device=device).to(dtype) for _ in range(2)]
            triton_kv_write.write_kv_triton(*got, rows, k, v, scales)
            write_kv_ref(*want, rows, k, v, scales)
            for g, w in zip(got, want):
                same = as_bytes(g) == as_bytes(w)
                assert same.float().mean() > 0.999, (dtype, kv_heads)
                if dtype in FP8:        # a division rounded differently moves at most one step
                    step = 2.0 ** -(2 if dtype == torch.float8_e5m2 else 3)
                    assert (g.float() - w.float()).abs().le(step * w.float().abs() + 1e-6).all()
            cases += 1
    return cases + check_store_head_major(device)


def check_store_head_major(device: str) -> int:
    """Some rows of a step's K/V into head-major block buffers (the offload engine's tails):
    the kernel moves exactly the reference's bytes and leaves every other position alone."""
    from astream.ops import triton_kv_write

    cases = 0
    for dtype in (torch.bfloat16, FP8[0]):
        for kv_heads, head_dim in ((2, 64), (3, 40)):
            k, v = (torch.randn(6, kv_heads, head_dim, device=device).to(dtype) for _ in range(2))
            src_rows = torch.tensor([4, 0, 5], device=device)
            dst_index = torch.tensor([17, 3, 30], device=device)       # blocks 2, 0, 3 of 8 tokens
            got = [torch.randn(4, kv_heads, 8, head_dim, device=device).to(dtype) for _ in range(2)]
            want = [x.clone() for x in got]
            triton_kv_write.store_head_major_triton(*(as_bytes(x) for x in got), dst_index,
                                                    as_bytes(k), as_bytes(v), src_rows)
            store_head_major_ref(*want, dst_index, k, v, src_rows)
            for g, w in zip(got, want):
                assert torch.equal(as_bytes(g), as_bytes(w)), (dtype, kv_heads)
            cases += 1
    return cases


def test_store_head_major_reference_puts_each_row_at_its_block_and_offset():
    k, v = torch.randn(5, 2, 4), torch.randn(5, 2, 4)
    dst_k, dst_v = torch.zeros(3, 2, 4, 4), torch.zeros(3, 2, 4, 4)
    store_head_major_ref(dst_k, dst_v, torch.tensor([9, 2]), k, v, torch.tensor([3, 1]))
    assert torch.equal(dst_k[2, :, 1], k[3]) and torch.equal(dst_v[0, :, 2], v[1])
    assert dst_k.count_nonzero() == 2 * 2 * 4                   # nothing else written


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the compiled kernels are tested")
def test_layer_kernels_interpreter_match_references():
    assert run_interpreted_check("test_layer_kernels", "check_layer_kernels") == 20


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the compiled kernels are tested")
def test_kv_write_interpreter_matches_reference():
    assert run_interpreted_check("test_layer_kernels", "check_kv_write") == 10


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_layer_kernels_on_gpu_match_references():
    assert check_layer_kernels("cuda") == 20 and check_kv_write("cuda") == 10


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_kernel_rounds_every_product_as_the_reference_on_gpu(dtype):
    # Without q/k norm the kernel is pure multiplies and adds: each rounded like the reference,
    # it must match bit for bit (a fused multiply-add left 22% of bf16 elements off by an ulp).
    from astream.ops import triton_layer

    heads, kv_heads, head_dim, n = 32, 8, 128, 4096
    cos, sin = rope_tables(40960, head_dim, dtype, "cuda")
    positions = torch.randint(0, 40960, (n,), device="cuda")
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, device="cuda").to(dtype)
    got = triton_layer.qkv_rope_triton(qkv, positions, cos, sin, heads, kv_heads, None, None, 1e-6)
    want = layer_ref.qkv_rope_ref(qkv, positions, cos, sin, heads, kv_heads, None, None, 1e-6)
    for g, w in zip(got[:2], want[:2]):
        assert torch.equal(g, w)


def test_rope_reference_rotates_pairs_by_position_angle():
    heads, kv_heads, head_dim = 2, 1, 8
    cos, sin = rope_tables(16, head_dim, torch.float64, "cpu")
    qkv = torch.randn(2, (heads + 2 * kv_heads) * head_dim, dtype=torch.float64)
    q, k, v = layer_ref.qkv_rope_ref(qkv, torch.tensor([0, 9]), cos, sin, heads, kv_heads,
                                     None, None, 1e-6)
    assert torch.equal(q[0], qkv[0, :heads * head_dim].view(heads, head_dim))     # position 0
    x = qkv[1, :head_dim]
    pairs = torch.complex(x[:head_dim // 2], x[head_dim // 2:])
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).double() / head_dim))
    turned = pairs * torch.exp(1j * 9 * inv)
    assert torch.allclose(q[1, 0], torch.cat((turned.real, turned.imag)).to(q.dtype), atol=1e-6)
    assert torch.equal(v, qkv[:, -kv_heads * head_dim:].view(2, kv_heads, head_dim))


def test_add_rms_norm_reference_is_norm_of_sum():
    res, delta, w = torch.randn(3, 16), torch.randn(3, 16), torch.rand(16)
    normed, total = layer_ref.add_rms_norm_ref(res, delta, w, 1e-6)
    s = res + delta
    assert torch.equal(total, s)
    assert torch.allclose(normed, w * s / s.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt(), atol=1e-6)


def test_silu_mul_reference():
    gate_up = torch.randn(2, 10)
    g, u = gate_up[:, :5], gate_up[:, 5:]
    assert torch.allclose(layer_ref.silu_mul_ref(gate_up), g * torch.sigmoid(g) * u, atol=1e-6)


@pytest.mark.parametrize("dtype", FP8)
def test_kv_write_saturates_and_reads_back_within_fp8_error(dtype):
    torch.manual_seed(2)
    k = torch.randn(4, 2, 8) * 3
    k[0, 0, 0] = 1e9
    v = torch.randn(4, 2, 8)
    scales = (torch.tensor([0.01, 0.02]), torch.tensor([0.05, 0.1]))    # v stays in range
    dst_k, dst_v = torch.zeros(6, 2, 8, dtype=dtype), torch.zeros(6, 2, 8, dtype=dtype)
    write_kv(dst_k, dst_v, torch.tensor([5, 1, 2, 0]), k, v, scales)
    assert torch.isfinite(dst_k.float()).all() and torch.equal(dst_k[3].float(), torch.zeros(2, 8))
    back = dequantize_ref(dst_v[torch.tensor([5, 1, 2, 0])], scales[1], torch.float32)
    rel = 2.0 ** -(3 if dtype == torch.float8_e5m2 else 4)       # half a step of the mantissa
    assert ((back - v).abs() <= rel * v.abs() + 1e-3).all()           # (+ subnormal steps)
    assert dst_k[5, 0, 0].float() == torch.finfo(dtype).max


def test_quantize_kv_leaves_plain_rows_alone():
    k, v = torch.randn(3, 2, 4, dtype=torch.bfloat16), torch.randn(3, 2, 4, dtype=torch.bfloat16)
    assert all(a is b for a, b in zip(quantize_kv(k, v, None, torch.bfloat16), (k, v)))


def test_layer_kernels_select_reference_off_cuda():
    assert LayerKernels.select("cpu").name == "reference"
    assert math.isclose(LayerKernels().add_rms_norm(torch.ones(1, 4), None, torch.ones(4), 0.0)[0][0, 0].item(), 1.0)
