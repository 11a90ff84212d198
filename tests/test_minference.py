"""MInference (vertical-slash sparse prefill): the index against brute force, the pattern's
layout against the pattern, the reference attention against masked brute force, the
Triton kernel against the reference (interpreter on the CPU), and through the engine on
SmolLM2: sizes that cover everything give Full's tokens, chunked prefill included."""

from __future__ import annotations

import math

import pytest
import torch
from triton_interpreter import run_interpreted_check

from astream import LLM, SamplingParams
from astream.ops import minference as mi
from astream.ops.attention_ref import varlen_attention_ref
from astream.ops.varlen import VarlenMeta
from astream.policies import MInferencePolicy, make_policy


def random_qkv(n_q, n_k, heads=4, kv_heads=2, dim=16, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, h, dim, generator=gen) for n, h in ((n_q, heads), (n_k, kv_heads),
                                                                    (n_k, kv_heads)))
    return q.to(dtype), k.to(dtype), v.to(dtype)


def brute_index(q, k, last_q, vertical_size, slash_size, sink, local, scale):
    n_q, heads, _ = q.shape
    n_k, kv_heads, _ = k.shape
    offset, verticals, slashes = n_k - n_q, [], []
    for h in range(heads):
        col, diag = [0.0] * n_k, [0.0] * n_k
        for t in range(max(0, n_q - last_q), n_q):
            pos = t + offset
            s = torch.tensor([float(q[t, h].double() @ k[u, h // (heads // kv_heads)].double()) * scale
                              for u in range(pos + 1)], dtype=torch.float64)
            for u, p in enumerate(torch.softmax(s, 0).tolist()):
                col[u] += p
                diag[pos - u] += p
        col = [math.inf if u < sink else c for u, c in enumerate(col)]
        diag = [math.inf if d < local else c for d, c in enumerate(diag)]
        verticals.append(set(sorted(range(n_k), key=lambda u: -col[u])[:vertical_size]))
        slashes.append(set(sorted(range(n_k), key=lambda d: -diag[d])[:slash_size]))
    return verticals, slashes


@pytest.mark.parametrize("n_q,n_k,last_q", [(40, 40, 16), (30, 90, 64), (100, 130, 8)])
def test_index_matches_brute_force(n_q, n_k, last_q):
    q, k, _ = random_qkv(n_q, n_k, seed=n_q)
    got = mi.vertical_slash_index(q, k, last_q=last_q, vertical_size=12, slash_size=9, sink=3,
                                  local=4, scale=0.5)
    want_v, want_s = brute_index(q, k, last_q, 12, 9, 3, 4, 0.5)
    assert [set(row.tolist()) for row in got.verticals] == want_v
    assert [set(row.tolist()) for row in got.slashes] == want_s
    assert all(row.tolist() == sorted(row.tolist()) for row in got.verticals)
    assert all(row.tolist() == sorted(row.tolist(), reverse=True) for row in got.slashes)


# One head's weights: 16 rows x 90 keys x 4 bytes. A head, two, one KV head's four, all.
@pytest.mark.parametrize("budget", [1, 2 * 16 * 90 * 4, 4 * 16 * 90 * 4, 10**9])
def test_index_in_query_head_slices_is_the_same(monkeypatch, budget):
    q, k, _ = random_qkv(40, 90, heads=8, kv_heads=2, seed=5)
    kwargs = dict(last_q=16, vertical_size=12, slash_size=9, sink=3, local=4, scale=0.5)
    want = mi.vertical_slash_index(q, k, **kwargs)
    monkeypatch.setattr(mi, "ESTIMATE_BYTES", budget)
    got = mi.vertical_slash_index(q, k, **kwargs)
    assert torch.equal(got.verticals, want.verticals) and torch.equal(got.slashes, want.slashes)


def test_head_slices_keep_to_whole_kv_heads_or_to_one():
    from astream.ops.attention_ref import head_slices
    assert head_slices(32, 4, 100, 1000) == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert head_slices(32, 4, 100, 250) == [(h, h + 2) for h in range(0, 32, 2)]
    assert head_slices(32, 4, 100, 10) == [(h, h + 1) for h in range(32)]
    assert head_slices(6, 3, 100, 200) == [(h, h + 1) for h in range(6)]      # 2 does not divide 3
    assert head_slices(8, 4, 1, 10**9) == [(0, 8)]


def some_index(n_q, n_k, heads=4, seed=0):
    q, k, _ = random_qkv(n_q, n_k, heads=heads, seed=seed)
    return mi.vertical_slash_index(q, k, last_q=16, vertical_size=max(3, n_k // 9),
                                   slash_size=max(2, n_k // 13), sink=2, local=3, scale=0.3)


def brute_pattern(index, n_q, n_k, block, h):
    offset = n_k - n_q
    keep = torch.zeros(n_q, n_k, dtype=torch.bool)
    for t in range(n_q):
        s = t // block * block
        for u in range(t + offset + 1):
            band = any(s + offset - d <= u <= s + block - 1 + offset - d for d in index.slashes[h].tolist())
            keep[t, u] = band or u in index.verticals[h].tolist()
    return keep


@pytest.mark.parametrize("n_q,n_k,block", [(50, 50, 16), (37, 120, 16), (64, 200, 32)])
def test_pattern_mask_and_its_layout_match_the_definition(n_q, n_k, block):
    index = some_index(n_q, n_k, seed=n_k)
    layout = mi.vertical_slash_layout(index, n_q, n_k, block)
    for h in range(index.verticals.shape[0]):
        want = brute_pattern(index, n_q, n_k, block, h)
        assert torch.equal(mi.vertical_slash_mask_ref(index, n_q, n_k, block, h), want)
        for b in range(-(-n_q // block)):
            runs = [(int(layout.run_start[h, b, r]), int(layout.run_end[h, b, r]))
                    for r in range(int(layout.run_count[h, b]))]
            cols = layout.columns[h, b, :int(layout.column_count[h, b])].tolist()
            keys = [u for a, e in runs for u in range(a, e)] + cols
            assert len(keys) == len(set(keys)), "a key read twice"
            rows = want[b * block:(b + 1) * block]
            assert set(keys) >= set(torch.nonzero(rows.any(0)).flatten().tolist())
            assert all(rows[:, u].any() or u > b * block + n_k - n_q for u in keys)


def test_reference_attention_is_masked_brute_force():
    n_q, n_k, block = 30, 70, 16
    q, k, v = random_qkv(n_q, n_k, seed=7)
    index = some_index(n_q, n_k, seed=8)
    out, lse = mi.vertical_slash_attention_ref(q, k, v, index, block=block, scale=0.4)
    for h in range(4):
        keep = brute_pattern(index, n_q, n_k, block, h)
        for t in range(n_q):
            cols = torch.nonzero(keep[t]).flatten()
            s = k[cols, h // 2].double() @ q[t, h].double() * 0.4
            torch.testing.assert_close(lse[t, h].double(), torch.logsumexp(s, 0), atol=1e-5, rtol=0)
            torch.testing.assert_close(out[t, h].double(), torch.softmax(s, 0) @ v[cols, h // 2].double(),
                                       atol=1e-5, rtol=0)


def test_sizes_that_cover_everything_are_full_attention():
    n_q, n_k = 40, 100
    q, k, v = random_qkv(n_q, n_k, seed=9)
    index = mi.vertical_slash_index(q, k, last_q=64, vertical_size=n_k, slash_size=1, sink=0,
                                    local=0, scale=0.25)
    out, lse = mi.vertical_slash_attention_ref(q, k, v, index, block=16, scale=0.25)
    meta = VarlenMeta(torch.tensor([0, n_q]), torch.tensor([0, n_k]), n_q, n_k, [0, n_q], [0, n_k])
    ref_out, ref_lse = varlen_attention_ref(q, k, v, meta, causal=True, scale=0.25)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_a_planted_needle_column_is_kept():
    n = 512
    q, k, _ = random_qkv(n, n, heads=2, kv_heads=1, dim=32, seed=11)
    needle, topic = 300, torch.randn(32, generator=torch.Generator().manual_seed(12))
    q[-16:] += topic * 0.5                                 # the last queries ask about a topic
    k[needle, 0] = topic * 2                               # one middle key answers it
    index = mi.vertical_slash_index(q, k, last_q=16, vertical_size=8, slash_size=8, sink=2,
                                    local=4, scale=32 ** -0.5)
    assert all(needle in row.tolist() for row in index.verticals)


# ---- Triton kernel vs reference --------------------------------------------------------

# (n_q, n_k, heads, kv heads, dim, block, dtype): short last block, prefix, GQA, fp16.
KERNEL_CASES = [(70, 70, 4, 2, 32, 16, torch.float32), (40, 300, 2, 1, 64, 32, torch.float32),
                (33, 90, 4, 2, 64, 16, torch.float16), (130, 260, 8, 2, 128, 64, torch.float32)]


def check_triton_vertical_slash(device: str, tol: float = 2e-3) -> int:
    from astream.ops.triton_minference import vertical_slash_attention_triton
    for i, (n_q, n_k, heads, kvh, dim, block, dtype) in enumerate(KERNEL_CASES):
        if device == "cuda" and dtype == torch.float16:
            dtype = torch.bfloat16
        q, k, v = (x.to(device) for x in random_qkv(n_q, n_k, heads, kvh, dim, seed=50 + i, dtype=dtype))
        index = mi.vertical_slash_index(q, k, last_q=32, vertical_size=n_k // 7, slash_size=n_k // 11,
                                        sink=4, local=8, scale=dim ** -0.5)
        layout = mi.vertical_slash_layout(index, n_q, n_k, block)
        out, lse = vertical_slash_attention_triton(q, k, v, layout, block=block, scale=dim ** -0.5)
        ref_out, ref_lse = mi.vertical_slash_attention_ref(q.float(), k.float(), v.float(), index,
                                                           block=block, scale=dim ** -0.5)
        torch.testing.assert_close(out.float(), ref_out, atol=tol, rtol=tol)
        torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)
    return len(KERNEL_CASES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the compiled kernel is tested")
def test_triton_vertical_slash_interpreter_matches_reference():
    assert run_interpreted_check("test_minference", "check_triton_vertical_slash") == len(KERNEL_CASES)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_vertical_slash_on_gpu_matches_reference():
    assert check_triton_vertical_slash("cuda", tol=1e-2) == len(KERNEL_CASES)


# ---- through the engine ----------------------------------------------------------------

KW = dict(device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=2048)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
LONG = " ".join(f"Item {i} costs {i * 13 % 50} dollars and weighs {i % 7} pounds."
                for i in range(40)) + " Which item is the heaviest?"
PROMPTS = [LONG, "The quick brown fox", "def fibonacci(n):"]
EVERYTHING = MInferencePolicy(vertical_size=4096, slash_size=1, scale_with_length=False, block_size=16)


def test_policy_parameters_and_sizes_are_checked():
    for bad in (dict(vertical_size=0), dict(slash_size=-1), dict(block_size=48), dict(last_q=True),
                dict(sink=-1), dict(scale_with_length=1)):
        with pytest.raises(ValueError, match="MInferencePolicy"):
            MInferencePolicy(**bad)
    policy = make_policy("minference")
    assert policy.sizes(131072) == policy.sizes(32768) == (1000, 6096)
    assert policy.sizes(2000) == (1000, 2000)                   # never more than the keys
    scaled = MInferencePolicy(scale_with_length=True)
    assert scaled.sizes(131072) == (1000, 6096)
    assert scaled.sizes(32768) == (250, 1524)
    assert scaled.sizes(200) == (30, 100)                       # never below sink and local
    assert make_policy("minference+quest", 256).decode.budget_tokens == 256


@pytest.mark.parametrize("chunk", [pytest.param(None, id="one-chunk"), pytest.param(128, id="chunked")])
def test_sizes_covering_everything_give_fulls_tokens(smol_llm, chunk):
    want = [o.token_ids for o in smol_llm.generate(PROMPTS, GREEDY)]
    extra = {} if chunk is None else dict(max_num_batched_tokens=chunk)
    with LLM(**KW, sparse_policy=EVERYTHING, **extra) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want


def test_small_sizes_read_less_and_still_write_text():
    policy = MInferencePolicy(vertical_size=64, slash_size=64, scale_with_length=False, sink=4,
                              local=16, block_size=16)
    with LLM(**KW, sparse_policy=policy, max_num_batched_tokens=256) as llm:
        out = llm.generate([LONG], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
        stats = llm.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert all(0 < d < 1 for d in stats["minference_density"]), stats["minference_density"]
    assert sum(ch.isalpha() for ch in out.text) > len(out.text) // 3, out.text
