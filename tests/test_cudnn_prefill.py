"""Long prefill parts through cuDNN: the split of a chunk after its prefix into a prefix part
and a causal square (CPU, with the reference as the dense kernel), the dispatch rule, and
on a Hopper GPU the cuDNN path against the float32 reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from astream.executor.inputs import varlen_meta
from astream.ops import cudnn_attention
from astream.ops.attention import merge_into_rows_ref
from astream.ops.attention_ref import varlen_attention_ref
from astream.ops.backends import CUDNN_MIN_QUERIES, CUDNN_SHAPE_STEP, AttentionBackends, takes_cudnn

HEADS, KV_HEADS, DIM = 8, 2, 32


def random_qkv(n_q: int, n_k: int, device: str = "cpu", dtype=torch.float32, heads=HEADS,
               kv_heads=KV_HEADS, dim=DIM):
    gen = torch.Generator(device=device).manual_seed(n_q * 7919 + n_k)
    make = lambda n, h: torch.randn(n, h, dim, device=device, dtype=dtype, generator=gen)  # noqa: E731
    return make(n_q, heads), make(n_k, kv_heads), make(n_k, kv_heads)


def dense_reference(q, k, v, *, causal, scale):
    """A dense kernel with a top-left causal mask, as cuDNN's (the reference aligns bottom-right,
    which is the same when the square has as many keys as queries)."""
    assert not causal or q.shape[0] == k.shape[0]
    meta = varlen_meta([0, q.shape[0]], [0, k.shape[0]], q.device)
    return varlen_attention_ref(q, k, v, meta, causal=causal, scale=scale)


@pytest.mark.parametrize("n_q,prefix", [(37, 0), (37, 1), (40, 300), (1, 64)])
def test_prefix_and_square_merge_to_bottom_right_causal(n_q, prefix):
    q, k, v = random_qkv(n_q, prefix + n_q)
    meta = varlen_meta([0, n_q], [0, prefix + n_q], q.device)
    want_out, want_lse = varlen_attention_ref(q, k, v, meta, causal=True, scale=0.2)
    out, lse = cudnn_attention.one_sequence(dense_reference, merge_into_rows_ref, q, k, v,
                                            causal=True, scale=0.2)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_unmasked_part_is_one_dense_call():
    q, k, v = random_qkv(20, 90)
    calls = []

    def counting(*args, **kwargs):
        calls.append(kwargs["causal"])
        return dense_reference(*args, **kwargs)

    meta = varlen_meta([0, 20], [0, 90], q.device)
    out, _ = cudnn_attention.one_sequence(counting, merge_into_rows_ref, q, k, v, causal=False, scale=0.3)
    torch.testing.assert_close(out, varlen_attention_ref(q, k, v, meta, causal=False, scale=0.3)[0])
    assert calls == [False]


def test_fewer_keys_than_causal_queries_is_refused():
    q, k, v = random_qkv(10, 4)
    with pytest.raises(ValueError, match="10 queries over 4 keys"):
        cudnn_attention.one_sequence(dense_reference, merge_into_rows_ref, q, k, v, causal=True, scale=1.0)


@pytest.mark.parametrize("causal", [True, False])
def test_a_packed_batch_goes_one_sequence_at_a_time(causal):
    lens_q, lens_k = [50, 7, 64, 3], ([80, 7, 64, 9] if causal else [30, 12, 70, 5])
    cu_q, cu_k = [0], [0]
    for lq, lk in zip(lens_q, lens_k):
        cu_q.append(cu_q[-1] + lq)
        cu_k.append(cu_k[-1] + lk)
    q, k, v = random_qkv(cu_q[-1], cu_k[-1])
    meta = varlen_meta(cu_q, cu_k, q.device)
    taken = []

    def long_part(q, k, v, one):
        taken.append(("long", q.shape[0], k.shape[0]))
        return cudnn_attention.one_sequence(dense_reference, merge_into_rows_ref, q, k, v,
                                            causal=causal, scale=0.25)

    def short_part(q, k, v, one):
        taken.append(("short", q.shape[0], k.shape[0]))
        assert one.host_cu_seqlens_q == [0, q.shape[0]] and one.cu_seqlens_k.tolist() == [0, k.shape[0]]
        return varlen_attention_ref(q, k, v, one, causal=causal, scale=0.25)

    out, lse = cudnn_attention.by_sequence(long_part, short_part, q, k, v, meta,
                                           takes_long=lambda n_q, n_k: n_q >= 50)
    want_out, want_lse = varlen_attention_ref(q, k, v, meta, causal=causal, scale=0.25)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    assert [t[0] for t in taken] == ["long", "short", "long", "short"]
    assert [t[1:] for t in taken] == list(zip(lens_q, lens_k))


def test_only_long_parts_of_repeating_shapes_take_cudnn():
    step = CUDNN_SHAPE_STEP
    assert takes_cudnn(16 * step, 16 * step) and takes_cudnn(16 * step, 112 * step)
    assert not takes_cudnn(CUDNN_MIN_QUERIES - step, 16 * step)      # too short
    assert not takes_cudnn(16 * step + 7, 16 * step + 7)             # a ragged last chunk
    assert not takes_cudnn(16 * step, 16 * step + 300)               # a ragged prefix


def test_cpu_never_takes_the_cudnn_path():
    assert not AttentionBackends.select(torch.device("cpu"), torch.bfloat16, 128).cudnn_prefill
    assert not cudnn_attention.cudnn_attention_available(torch.device("cpu"), 128)


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("n_q,prefix,causal,dim", [(CUDNN_MIN_QUERIES + 1024, 0, True, 128),
                                                   (CUDNN_MIN_QUERIES, 3072, True, 128),
                                                   (CUDNN_MIN_QUERIES, 4096, False, 128),
                                                   (CUDNN_MIN_QUERIES + 77, 999, True, 128),
                                                   (CUDNN_MIN_QUERIES, 1024, True, 64)])
def test_cudnn_path_matches_reference_on_gpu(n_q, prefix, causal, dim, monkeypatch):
    backends = AttentionBackends.select(torch.device("cuda"), torch.bfloat16, dim)
    assert backends.cudnn_prefill
    calls = []
    real = cudnn_attention.cudnn_dense
    monkeypatch.setattr(cudnn_attention, "cudnn_dense", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    n_k = prefix + (n_q if causal else 0)
    q, k, v = random_qkv(n_q, n_k, "cuda", torch.bfloat16, heads=32, kv_heads=8, dim=dim)
    meta = varlen_meta([0, n_q], [0, n_k], q.device)
    out, lse = backends.varlen(q, k, v, meta, causal=causal, scale=dim ** -0.5)
    want_out, want_lse = varlen_attention_ref(q.float(), k.float(), v.float(), meta, causal=causal,
                                              scale=dim ** -0.5)
    flash_out, _ = dataclasses.replace(backends, cudnn_prefill=False).varlen(
        q, k, v, meta, causal=causal, scale=dim ** -0.5)
    assert out.shape == want_out.shape and out.dtype == torch.bfloat16
    assert bool(calls) == takes_cudnn(n_q, n_k)
    err = (out.float() - want_out).abs().max().item()
    assert err <= 2 * (flash_out.float() - want_out).abs().max().item() + 1e-3
    assert (lse - want_lse).abs().max().item() < 1e-2


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
def test_packed_batch_with_a_long_sequence_matches_reference_on_gpu():
    backends = AttentionBackends.select(torch.device("cuda"), torch.bfloat16, 128)
    cu_q, cu_k = [0, 300, 300 + CUDNN_MIN_QUERIES], [0, 700, 700 + CUDNN_MIN_QUERIES + 1024]
    q, k, v = random_qkv(cu_q[-1], cu_k[-1], "cuda", torch.bfloat16, heads=32, kv_heads=8, dim=128)
    meta = varlen_meta(cu_q, cu_k, q.device)
    out, lse = backends.varlen(q, k, v, meta, causal=True, scale=128 ** -0.5)
    want_out, want_lse = varlen_attention_ref(q.float(), k.float(), v.float(), meta, causal=True,
                                              scale=128 ** -0.5)
    assert (out.float() - want_out).abs().max().item() < 2e-2 * want_out.abs().max().item()
    assert (lse - want_lse).abs().max().item() < 1e-2


def test_a_failing_cudnn_part_falls_back_to_the_varlen_kernel(monkeypatch):
    """cuDNN refusing a shape at run time (no plan) costs speed, not the request; running out
    of memory is not hidden."""
    backends = AttentionBackends("reference", "reference", cudnn_prefill=True)
    n = CUDNN_MIN_QUERIES
    q, k, v = random_qkv(n, 2 * n)
    meta = varlen_meta([0, n], [0, 2 * n], q.device)
    want = varlen_attention_ref(q, k, v, meta, causal=True, scale=0.2)

    def no_plan(*args, **kwargs):
        raise RuntimeError("cuDNN Frontend error: No execution plans support the graph.")

    monkeypatch.setattr(cudnn_attention, "cudnn_dense", no_plan)
    with pytest.warns(RuntimeWarning, match="No execution plans"):
        out, lse = backends.varlen(q, k, v, meta, causal=True, scale=0.2)
    torch.testing.assert_close(out, want[0])
    torch.testing.assert_close(lse, want[1])

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(cudnn_attention, "cudnn_dense", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        backends.varlen(q, k, v, meta, causal=True, scale=0.2)
