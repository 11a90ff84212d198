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


SMALL = cudnn_attention.ShapeLadder(step=8, max_queries=32, max_keys=64)


@pytest.mark.parametrize("n_q,prefix,causal", [(56, 200, True), (56, 0, True), (24, 72, False),
                                               (32, 64, True), (40, 8, True)])
def test_ladder_parts_merge_to_the_reference_and_use_only_ladder_shapes(n_q, prefix, causal):
    """A chunk of 56 rows (32 + 16 + 8) over 200 keys of prefix (64 + 64 + 64 + 8): every
    part cuDNN would see has a ladder shape, and the parts merge to exact attention."""
    n_k = prefix + (n_q if causal else 0)
    q, k, v = random_qkv(n_q, n_k)
    seen = []

    def recording(q, k, v, *, causal, scale):
        seen.append((q.shape[0], k.shape[0], causal))
        return dense_reference(q, k, v, causal=causal, scale=scale)

    out, lse = cudnn_attention.one_sequence(recording, merge_into_rows_ref, q, k, v, causal=causal,
                                            scale=0.3, ladder=SMALL)
    meta = varlen_meta([0, n_q], [0, n_k], q.device)
    want_out, want_lse = varlen_attention_ref(q, k, v, meta, causal=causal, scale=0.3)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    assert set(seen) <= set(SMALL.shapes(n_q, n_k))
    assert all(n in (8, 16, 32, 64) for shape in seen for n in shape[:2])


def test_every_chunk_the_engine_sends_meets_only_shapes_planned_at_startup():
    """Chunks of any multiple of the step up to the batch budget, after any aligned prefix up
    to max_model_len, see only the shapes `warm_up` builds; their count stays small."""
    budget, max_len, step = 8192, 32768, CUDNN_SHAPE_STEP
    planned = set(cudnn_attention.LADDER.shapes(budget, max_len))
    assert len(planned) <= 32
    seen = set()

    def shapes_only(q, k, v, *, causal, scale):
        seen.add((q.shape[0], k.shape[0], causal))
        return torch.zeros_like(q), torch.zeros(q.shape[:2])

    def no_merge(out, lse, rows, part_out, part_lse):
        return out, lse

    for n_q in range(CUDNN_MIN_QUERIES, budget + 1, step):
        for prefix in range(0, max_len - n_q + 1, step):
            q, k = torch.empty(n_q, 1, 1), torch.empty(prefix + n_q, 1, 1)
            assert takes_cudnn(n_q, prefix + n_q)
            cudnn_attention.one_sequence(shapes_only, no_merge, q, k, k, causal=True, scale=1.0)
    assert seen <= planned


def test_warm_up_runs_each_planned_shape_once_and_the_merge():
    calls, merges = [], []

    def recording(q, k, v, *, causal, scale):
        calls.append((q.shape[0], k.shape[0], causal))
        assert q.shape[1:] == (4, 16) and k.shape[1:] == v.shape[1:] == (2, 16)
        assert q.is_contiguous() and k.is_contiguous()
        return dense_reference(q, k, v, causal=causal, scale=scale)

    def merging(*args):
        merges.append(args[2].shape[0])
        return merge_into_rows_ref(*args)

    count = cudnn_attention.warm_up(recording, merging, 56, 200, 4, 2, 16, torch.float32,
                                    torch.device("cpu"), 0.25, ladder=SMALL)
    assert merges == [8]                                   # one block of 8 rows: square + piece
    assert count == len(set(calls)) == len(calls) - 2
    assert set(calls) == set(SMALL.shapes(56, 200))
    assert {c for c in calls if c[2]} == {(8, 8, True), (16, 16, True), (32, 32, True)}


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
@pytest.mark.parametrize("n_q,prefix", [(7168, 5120), (3072, 70656)])
def test_ladder_blocks_and_pieces_match_reference_on_gpu(n_q, prefix):
    """Several query blocks (4096 + 2048 + 1024) over several key pieces, and a prefix past the
    ladder's largest piece, on cuDNN against the float32 reference."""
    backends = AttentionBackends.select(torch.device("cuda"), torch.bfloat16, 128)
    n_k = prefix + n_q
    q, k, v = random_qkv(n_q, n_k, "cuda", torch.bfloat16, heads=4, kv_heads=2, dim=128)
    meta = varlen_meta([0, n_q], [0, n_k], q.device)
    out, lse = backends.varlen(q, k, v, meta, causal=True, scale=128 ** -0.5)
    want_out, want_lse = varlen_attention_ref(q.float(), k.float(), v.float(), meta, causal=True,
                                              scale=128 ** -0.5)
    assert (out.float() - want_out).abs().max().item() < 2e-2 * want_out.abs().max().item()
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


def _generate_once(llm, prompt: list[int], params) -> list[int]:
    """The tokens of one prompt, then the engine closed."""
    try:
        return llm.generate([prompt], params)[0].token_ids
    finally:
        llm.close()


def _take_the_cudnn_path(monkeypatch, dense) -> None:
    """Engines built from here on prefill long parts through `dense`, in cuDNN's place (CPU)."""
    monkeypatch.setattr(AttentionBackends, "select",
                        classmethod(lambda cls, *a: cls("reference", "reference", cudnn_prefill=True)))
    monkeypatch.setattr(cudnn_attention, "cudnn_dense", dense)


def test_the_engine_plans_every_shape_at_startup_and_its_prefills_meet_no_other(
        tiny_qwen3, tmp_path, monkeypatch):
    """Through the engine (CPU, the reference kernel standing in for cuDNN): building it plans
    the ladder's shapes; a long prompt's chunks then meet only those, and its tokens are the
    plain path's."""
    import json
    import shutil

    from astream import LLM, SamplingParams

    model = shutil.copytree(tiny_qwen3, tmp_path / "long")       # the same weights, 8K positions
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    calls: dict[str, list] = {"startup": [], "prefill": []}
    phase = ["startup"]

    def standing_in(q, k, v, *, causal, scale):
        calls[phase[0]].append((q.shape[0], k.shape[0], causal))
        if phase[0] == "startup":                            # shapes only: skip the arithmetic
            return torch.zeros_like(q), torch.zeros(q.shape[:2])
        return dense_reference(q, k, v, causal=causal, scale=scale)

    prompt = torch.randint(100, 2000, (4096,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    options = dict(device="cpu", dtype="float32", max_model_len=8192, max_num_batched_tokens=2048,
                   max_num_seqs=2)
    want = _generate_once(LLM(str(model), **options), prompt, params)
    _take_the_cudnn_path(monkeypatch, standing_in)
    llm = LLM(str(model), **options)
    phase[0] = "prefill"
    got = _generate_once(llm, prompt, params)
    assert set(calls["startup"]) == set(cudnn_attention.LADDER.shapes(2048, 8192))
    assert (2048, 2048, True) in calls["prefill"] and (2048, 2048, False) in calls["prefill"]
    assert set(calls["prefill"]) <= set(calls["startup"])
    assert got == want


def test_an_engine_whose_cudnn_fails_at_startup_starts_on_the_varlen_kernel(
        tiny_qwen3, monkeypatch, caplog):
    """cuDNN failing while the plans are built (a library mismatch, no memory) turns cuDNN
    prefill off with a warning; the engine starts and generates as without it."""
    from astream import LLM, SamplingParams

    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("cuDNN Frontend error: no execution plan")

    prompt = torch.randint(100, 2000, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    want = _generate_once(LLM(str(tiny_qwen3), device="cpu", dtype="float32"), prompt, params)
    _take_the_cudnn_path(monkeypatch, broken)
    with caplog.at_level("WARNING", logger="astream"):
        llm = LLM(str(tiny_qwen3), device="cpu", dtype="float32")
    assert _generate_once(llm, prompt, params) == want
    assert calls == [1]                                  # tried at startup, then off
    assert any("cuDNN prefill attention is off" in r.getMessage() for r in caplog.records)
