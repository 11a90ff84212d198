"""XAttention (sparse prefill): the scoring, the threshold selection and the block-sparse
attention against brute force; its Triton kernel against the reference (interpreter on the
CPU); and through the engine on SmolLM2: threshold 1 gives Full's tokens, chunked prefill
included, a lower one reads fewer blocks and still writes text."""

from __future__ import annotations

import math

import pytest
import torch
from triton_interpreter import run_interpreted_check

from astream import LLM, SamplingParams
from astream.ops import xattention as xa
from astream.ops.attention_ref import varlen_attention_ref
from astream.ops.varlen import VarlenMeta
from astream.policies import CombinedPolicy, QuestPolicy, XAttentionPolicy, make_policy


def random_qkv(n_q, n_k, heads=4, kv_heads=2, dim=16, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n_q, heads, dim, generator=gen)
    k = torch.randn(n_k, kv_heads, dim, generator=gen)
    v = torch.randn(n_k, kv_heads, dim, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def brute_scores(q, k, block, stride, scale):
    n_q, heads, _ = q.shape
    n_k, kv_heads, _ = k.shape
    groups_q, groups_k = -(-n_q // stride), -(-n_k // stride)
    offset = n_k - n_q
    out = torch.zeros(heads, -(-n_q // block), -(-n_k // block), dtype=torch.float64)
    for h in range(heads):
        kh = h // (heads // kv_heads)
        for i in range(groups_q):
            est = []
            for j in range(groups_k):
                if j * stride > min(i * stride + stride - 1, n_q - 1) + offset:
                    est.append(-math.inf)
                    continue
                total = 0.0
                for s in range(stride):
                    t, u = i * stride + stride - 1 - s, j * stride + s
                    if t < n_q and u < n_k:
                        total += float(q[t, h].double() @ k[u, kh].double())
                est.append(total * scale / stride)
            probs = torch.softmax(torch.tensor(est, dtype=torch.float64), 0)
            for j in range(groups_k):
                out[h, i * stride // block, j * stride // block] += probs[j]
    rows = torch.tensor([-(-min(block, n_q - a * block) // stride) for a in range(out.shape[1])])
    return out / rows.view(1, -1, 1)


@pytest.mark.parametrize("n_q,n_k,block,stride", [(64, 64, 16, 4), (37, 101, 16, 8), (20, 20, 16, 2)])
def test_antidiagonal_scores_match_brute_force(n_q, n_k, block, stride):
    q, k, _ = random_qkv(n_q, n_k, seed=n_q)
    got = xa.antidiagonal_scores_ref(q, k, block=block, stride=stride, scale=0.25)
    torch.testing.assert_close(got.double(), brute_scores(q, k, block, stride, 0.25),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.sum(-1), torch.ones(got.shape[:2]), atol=1e-5, rtol=0)


def brute_select(row, threshold, visible_last, diag_first):
    forced = {0} | set(range(diag_first, visible_last + 1))
    keep, total = set(forced), sum(float(row[b]) for b in forced)
    rest = sorted((b for b in range(visible_last + 1) if b not in forced),
                  key=lambda b: (-float(row[b]), b))
    for b in rest:
        if total >= threshold:
            break
        keep.add(b)
        total += float(row[b])
    return keep


@pytest.mark.parametrize("threshold", [0.3, 0.7, 0.95, 1.0])
def test_threshold_selection_matches_brute_force(threshold):
    n_q, n_k, block = 70, 150, 16
    q, k, _ = random_qkv(n_q, n_k, seed=3)
    scores = xa.antidiagonal_scores_ref(q, k, block=block, stride=4, scale=0.5)
    mask = xa.select_blocks_ref(scores, threshold=threshold, n_q=n_q, n_k=n_k, block=block)
    first, last = xa.visible_blocks(n_q, n_k, block, torch.device("cpu"))
    for h in range(scores.shape[0]):
        for a in range(scores.shape[1]):
            want = set(range(int(last[a]) + 1)) if threshold >= 1 else \
                brute_select(scores[h, a], threshold, int(last[a]), int(first[a]))
            assert set(torch.nonzero(mask[h, a]).flatten().tolist()) == want, (h, a)


def naive_block_sparse(q, k, v, mask, block, scale):
    n_q, heads, _ = q.shape
    n_k, kv_heads, _ = k.shape
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((n_q, heads), -math.inf, dtype=torch.float64)
    for h in range(heads):
        kh = h // (heads // kv_heads)
        for t in range(n_q):
            cols = [u for u in range(n_k) if u <= t + n_k - n_q and mask[h, t // block, u // block]]
            if cols:
                s = k[cols, kh].double() @ q[t, h].double() * scale
                lse[t, h] = torch.logsumexp(s, 0)
                out[t, h] = torch.softmax(s, 0) @ v[cols, kh].double()
    return out, lse


def test_block_sparse_reference_is_masked_dense_attention():
    q, k, v = random_qkv(40, 90, seed=5)
    mask = torch.rand(4, 3, 6, generator=torch.Generator().manual_seed(1)) < 0.5
    mask[0, 0] = False                                    # a block with no key at all
    out, lse = xa.block_sparse_attention_ref(q, k, v, mask, block=16, scale=0.3)
    want_out, want_lse = naive_block_sparse(q, k, v, mask, 16, 0.3)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    assert torch.all(out[:16, 0] == 0) and torch.all(torch.isneginf(lse[:16, 0]))


def test_threshold_one_is_full_attention():
    q, k, v = random_qkv(50, 120, seed=6)
    scores = xa.antidiagonal_scores_ref(q, k, block=16, stride=8, scale=0.25)
    mask = xa.select_blocks_ref(scores, threshold=1.0, n_q=50, n_k=120, block=16)
    out, lse = xa.block_sparse_attention_ref(q, k, v, mask, block=16, scale=0.25)
    meta = VarlenMeta(torch.tensor([0, 50]), torch.tensor([0, 120]), 50, 120, [0, 50], [0, 120])
    ref_out, ref_lse = varlen_attention_ref(q, k, v, meta, causal=True, scale=0.25)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    assert xa.density(mask, 50, 120, 16) == 1.0


def test_a_planted_needle_block_is_kept():
    """Keys in one middle block aligned with the last queries win that query block."""
    n, block, dim = 256, 32, 32
    for seed in range(4):
        q, k, _ = random_qkv(n, n, heads=2, kv_heads=1, dim=dim, seed=seed)
        needle = 2 + seed                                  # key block 2..5, far from the diagonal
        k[needle * block:(needle + 1) * block, 0] = 2.0 * q[-block:, 0].mean(0)
        scores = xa.antidiagonal_scores_ref(q, k, block=block, stride=8, scale=dim ** -0.5)
        mask = xa.select_blocks_ref(scores, threshold=0.5, n_q=n, n_k=n, block=block)
        assert mask[0, -1, needle]
        assert xa.density(mask, n, n, block) < 1.0


# ---- Triton kernel vs reference --------------------------------------------------------

# (n_q, n_k, heads, kv heads, dim, block, threshold, dtype)
KERNEL_CASES = [(70, 70, 4, 2, 32, 16, 0.7, torch.float32), (40, 100, 2, 1, 64, 32, 1.0, torch.float32),
                (33, 90, 4, 2, 64, 16, 0.5, torch.float16), (130, 260, 8, 2, 128, 64, 0.9, torch.float32)]


def check_triton_block_sparse(device: str, tol: float = 2e-3) -> int:
    from astream.ops.triton_xattention import block_sparse_attention_triton
    for i, (n_q, n_k, heads, kvh, dim, block, threshold, dtype) in enumerate(KERNEL_CASES):
        if device == "cuda" and dtype == torch.float16:
            dtype = torch.bfloat16                   # the engine's dtype; the interpreter lacks it
        q, k, v = (x.to(device) for x in random_qkv(n_q, n_k, heads, kvh, dim, seed=40 + i,
                                                     dtype=dtype))
        scores = xa.antidiagonal_scores_ref(q, k, block=block, stride=8, scale=dim ** -0.5)
        mask = xa.select_blocks_ref(scores, threshold=threshold, n_q=n_q, n_k=n_k, block=block)
        out, lse = block_sparse_attention_triton(q, k, v, mask, block=block, scale=dim ** -0.5)
        ref_out, ref_lse = xa.block_sparse_attention_ref(q.float(), k.float(), v.float(), mask,
                                                         block=block, scale=dim ** -0.5)
        torch.testing.assert_close(out.float(), ref_out, atol=tol, rtol=tol)
        torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)
    return len(KERNEL_CASES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the compiled kernel is tested")
def test_triton_block_sparse_interpreter_matches_reference():
    assert run_interpreted_check("test_xattention", "check_triton_block_sparse") == len(KERNEL_CASES)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_block_sparse_on_gpu_matches_reference():
    assert check_triton_block_sparse("cuda", tol=1e-2) == len(KERNEL_CASES)


# (n_q, n_k, heads, kv heads, dim, block, stride): short last blocks, a prefix before the
# chunk, a chunk longer than a program's query groups, blocks of fewer than 16 groups.
SCORE_CASES = [(300, 300, 4, 2, 32, 64, 8), (200, 1100, 2, 1, 64, 128, 8),
               (1100, 1500, 4, 4, 16, 16, 4), (70, 70, 2, 1, 32, 128, 16),
               (1100, 1503, 2, 1, 16, 64, 8)]     # query slices end inside a key group


def check_triton_scores(device: str, tol: float = 1e-4, scratch: float = 0,
                        splits: float = 0) -> int:
    """`scratch` > 0 bounds the kernel's scratch bytes, so long chunks go in query slices;
    `splits` > 0 splits each program's key tiles that many ways (0: the kernel's choice)."""
    from astream.ops import triton_xattention_scores as kernels
    default, kernels.SCRATCH_BYTES = kernels.SCRATCH_BYTES, int(scratch) or kernels.SCRATCH_BYTES
    try:
        for case in enumerate(SCORE_CASES):
            _check_scores_case(device, tol, *case, splits=int(splits) or None)
    finally:
        kernels.SCRATCH_BYTES = default
    return len(SCORE_CASES)


def _check_scores_case(device, tol, i, case, splits=None):
    from astream.ops.triton_xattention_scores import antidiagonal_scores_triton
    n_q, n_k, heads, kvh, dim, block, stride = case
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, _ = (x.to(device) for x in random_qkv(n_q, n_k, heads, kvh, dim, seed=60 + i, dtype=dtype))
    got = antidiagonal_scores_triton(q, k, block=block, stride=stride, scale=dim ** -0.5,
                                     key_splits=splits)
    want = xa.antidiagonal_scores_ref(q, k, block=block, stride=stride, scale=dim ** -0.5)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the compiled kernel is tested")
@pytest.mark.parametrize("scratch,splits", [(0, 0), (4096, 0), (0, 4), (4096, 2)],
                         ids=["one-launch", "query-slices", "key-splits", "both"])
def test_triton_scores_interpreter_match_reference(scratch, splits):
    assert run_interpreted_check("test_xattention", "check_triton_scores", 1e-4,
                                 scratch, splits) == len(SCORE_CASES)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_scores_on_gpu_match_reference():
    assert check_triton_scores("cuda", tol=1e-2) == len(SCORE_CASES)
    assert check_triton_scores("cuda", tol=1e-2, scratch=4096) == len(SCORE_CASES)
    assert check_triton_scores("cuda", tol=1e-2, splits=8) == len(SCORE_CASES)
    assert check_triton_scores("cuda", tol=1e-2, scratch=4096, splits=64) == len(SCORE_CASES)


# ---- through the engine ----------------------------------------------------------------

KW = dict(device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=2048)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
LONG = " ".join(f"Item {i} costs {i * 13 % 50} dollars and weighs {i % 7} pounds."
                for i in range(40)) + " Which item is the heaviest?"
PROMPTS = [LONG, "The quick brown fox", "def fibonacci(n):"]


def test_policy_parameters_are_checked():
    for bad in (dict(threshold=0), dict(threshold=1.5), dict(block_size=48), dict(stride=0),
                dict(block_size=16, stride=32), dict(threshold=True)):
        with pytest.raises(ValueError, match="XAttentionPolicy"):
            XAttentionPolicy(**bad)
    with pytest.raises(ValueError, match="no budget"):
        make_policy("xattention", 1024)
    assert isinstance(make_policy("xattention"), XAttentionPolicy)


@pytest.mark.parametrize("chunk", [pytest.param(None, id="one-chunk"), pytest.param(128, id="chunked")])
def test_threshold_one_gives_fulls_tokens(smol_llm, chunk):
    want = [o.token_ids for o in smol_llm.generate(PROMPTS, GREEDY)]
    extra = {} if chunk is None else dict(max_num_batched_tokens=chunk)
    policy = XAttentionPolicy(threshold=1.0, block_size=16, stride=4)
    with LLM(**KW, sparse_policy=policy, **extra) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
        assert all(d == 1.0 for d in llm.stats()["xattention_density"])


def test_a_lower_threshold_reads_fewer_blocks_and_still_writes_text():
    policy = XAttentionPolicy(threshold=0.6, block_size=16, stride=4)
    with LLM(**KW, sparse_policy=policy, max_num_batched_tokens=256) as llm:
        out = llm.generate([LONG], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
        density = llm.stats()["xattention_density"]
        assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]
    assert all(0 < d < 1 for d in density), density
    assert sum(ch.isalpha() for ch in out.text) > len(out.text) // 3, out.text


def test_xattention_with_a_quest_budget_that_covers_everything_gives_fulls_tokens(smol_llm):
    want = [o.token_ids for o in smol_llm.generate(PROMPTS, GREEDY)]
    policy = CombinedPolicy(prefill=XAttentionPolicy(threshold=1.0, block_size=16, stride=4),
                            decode=QuestPolicy(budget_tokens=4096, dense_layers=0))
    with LLM(**KW, sparse_policy=policy, max_num_batched_tokens=128) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want


def test_xattention_prefill_and_quest_decode_combine_by_name():
    with LLM(**KW, sparse_policy="xattention+quest", sparse_budget=128) as llm:
        out = llm.generate([LONG], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
        stats = llm.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert all(0 < d <= 1 for d in stats["xattention_density"])
    pages, rows = stats["quest_pages_read"], stats["quest_selections"]
    assert pages[:2] == rows[:2] == [0, 0]                       # Quest's dense layers
    assert all(r > 0 and p == 8 * r for p, r in zip(pages[2:], rows[2:]))    # 128 / 16
    assert sum(ch.isalpha() for ch in out.text) > len(out.text) // 3, out.text


def test_combinations_are_checked():
    combined = make_policy("quest+xattention", 512)
    assert (combined.name, combined.decode.budget_tokens) == ("xattention+quest", 512)
    for spec, message in (("quest+quest", "one prefill policy"), ("xattention+full", "one prefill"),
                          ("xattention+quest+quest", "exactly two"), ("xattention+nope", "unknown")):
        with pytest.raises(ValueError, match=message):
            make_policy(spec)
    with pytest.raises(ValueError, match="decode must be a decode policy"):
        CombinedPolicy(prefill=XAttentionPolicy(), decode=XAttentionPolicy())
