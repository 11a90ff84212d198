"""benchmarks/sparse_reference.py's restatement of XAttention's reference selection, and the
one difference from astream's rule that docs/BENCHMARKS.md documents as intended."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import sparse_reference as sr  # noqa: E402
from sparse_reference import xattention_reference_effective  # noqa: E402

from astream.ops import xattention as xa  # noqa: E402


def reference_steps(row: list[float], r: int, threshold: float) -> set[int]:
    """find_blocks_chunked's steps for query block r of a chunk without prefix, one by one:
    only the diagonal forced, running sums of [0, F, others sorted[:-2]] shifted by one,
    entries not kept written as block 0."""
    forced = row[r]
    others = sorted(((row[c], c) for c in range(len(row)) if c != r), key=lambda x: -x[0])
    values = [0.0, forced] + [v for v, _ in others][:-1]
    order = [r] + [c for _, c in others]
    required = sum(row) * threshold
    kept = {column if sum(values[:position]) < required else 0
            for position, column in enumerate(order)}
    return {c for c in kept if c <= r}


def test_restated_reference_selection_follows_its_steps():
    torch.manual_seed(0)
    n_qb, threshold = 7, 0.8
    logits = torch.randn(4, n_qb, n_qb) * 2
    visible = torch.arange(n_qb).view(1, -1) <= torch.arange(n_qb).view(-1, 1)
    scores = torch.softmax(logits.masked_fill(~visible, float("-inf")), -1)
    mask = xattention_reference_effective(scores, threshold)
    for h in range(4):
        for r in range(n_qb):
            want = reference_steps(scores[h, r].tolist(), r, threshold)
            assert set(mask[h, r].nonzero().flatten().tolist()) == want, (h, r)


def test_astream_keeps_the_fewest_blocks_that_reach_the_threshold():
    # The reference keeps one block past the threshold; astream's rule stops at it: with
    # the first and diagonal blocks forced, dropping the lowest kept other block falls short.
    torch.manual_seed(1)
    n, block, threshold = 1024, 64, 0.9
    q, k = torch.randn(n, 2, 32), torch.randn(n, 1, 32)
    scores = xa.antidiagonal_scores_ref(q, k, block=block, stride=8, scale=32 ** -0.5)
    mask = xa.select_blocks_ref(scores, threshold=threshold, n_q=n, n_k=n, block=block)
    for h in range(2):
        for r in range(1, mask.shape[1]):
            kept = mask[h, r].nonzero().flatten().tolist()
            others = [c for c in kept if c not in (0, r)]
            if others:
                lowest = min(others, key=lambda c: float(scores[h, r, c]))
                assert float(scores[h, r, kept].sum() - scores[h, r, lowest]) < threshold
            assert float(scores[h, r, kept].sum()) >= threshold - 1e-6


# ---- FlexPrefill ------------------------------------------------------------------------

def test_average_pool_stand_in_is_each_blocks_mean():
    x = torch.randn(1, 300, 3, 8, generator=torch.Generator().manual_seed(2))
    got = sr.bnhd_avg_pool(x, 128)
    assert got.shape == (1, 3, 3, 8)
    for b, (lo, hi) in enumerate(((0, 128), (128, 256), (256, 300))):      # a short last block
        torch.testing.assert_close(got[0, b], x[0, lo:hi].mean(0))
    assert torch.equal(sr.rearrange_heads(torch.arange(24).view(1, 2, 3, 2, 2), "b h g i j -> b (h g) i j"),
                       torch.arange(24).view(1, 6, 2, 2))


def reference_rule_steps(vertical, slash_far_first, qa, aware, counts, gamma, min_b, max_b, n_b):
    """get_active_blocks's steps from its block scores on, in its own index arithmetic:
    flattened (query block * n_b + key block) indices, its slash indexed from the farthest
    diagonal, top-k with the first column and the nearest diagonal set to inf, entries out
    of the grid or above the causal diagonal written as index 0, query-aware entries kept
    while the running sum stays at most gamma * n_b."""
    out = []
    for h in range(vertical.shape[0]):
        sizes = []
        for raw in counts:
            size = max(int(raw[h]) // 128 + 1, min_b)
            size = min_b if aware[h] else min(size, min(max_b, n_b))
            sizes.append(min(size, n_b))
        v, s = vertical[h].clone(), slash_far_first[h].clone()
        v[0], s[-1] = float("inf"), float("inf")
        columns = v.topk(sizes[0]).indices.tolist()
        diagonals = [(n_b - 1) - x for x in s.topk(sizes[1]).indices.tolist()]
        index = {i * n_b + c if c <= i else 0 for i in range(n_b) for c in columns}
        index |= {(i + d) * n_b + i if i + d < n_b else 0 for i in range(n_b) for d in diagonals}
        if aware[h]:
            values, order = qa[h].flatten().sort(descending=True)
            index |= {int(o) if float(c) <= gamma * n_b else 0
                      for o, c in zip(order, values.cumsum(0))}
        out.append({divmod(x, n_b) for x in index})
    return out


def test_restated_flexprefill_rule_follows_the_references_steps():
    gen = torch.Generator().manual_seed(3)
    heads, n_b, gamma, min_b, max_b = 6, 12, 0.9, 2, 7
    vertical = torch.softmax(torch.randn(heads, n_b, generator=gen) * 2, -1)
    slash = torch.softmax(torch.randn(heads, n_b, generator=gen) * 2, -1)      # by distance
    causal = torch.arange(n_b).view(1, -1) <= torch.arange(n_b).view(-1, 1)
    qa = torch.softmax((torch.randn(heads, n_b, n_b, generator=gen) * 2).masked_fill(~causal, float("-inf")), -1)
    aware = [True, False, True, False, False, False]
    counts = (torch.tensor([0, 300, 900, 2000, 5, 700]), torch.tensor([130, 0, 50, 1500, 400, 260]))
    got = sr.flexprefill_reference_rule(vertical, slash, qa, aware, counts, gamma=gamma,
                                        min_blocks=min_b, max_blocks=max_b, n_b=n_b)
    want = reference_rule_steps(vertical, slash.flip(-1), qa, aware, counts, gamma, min_b, max_b, n_b)
    assert got == want
    visible = n_b * (n_b + 1) // 2
    sizes = sorted(len(x) for x in got)
    assert n_b < sizes[0] and sizes[-1] < visible                    # neither forced-only nor full
    # counts clamped from below, from above, and query-aware heads at the minimum
    assert len({len(x) for x in got}) > 2


FAKE_REFERENCE = '''
def torch_bhn_sumpool(x, kernel_size):
    return x * kernel_size

def score_cover_topk(x, score):
    return (x.sum(-1) * 1000).round().long()

def score_cover_idx(x, score, padding_value=0):
    return x.argsort(descending=True)[:1]

def sum_all_diagonal_matrix(mat):
    return mat

def transform_veritcal_slash_idx(v_idx, s_idx, num_blocks):
    return None

def square_root_js_divergence(p, q):
    return (p - q).abs().sum(-1)

def get_active_blocks(q, k, v, block_size, gamma, min_budget, max_budget, tau=0, gqa_interleave=False):
    n_b = math.ceil(q.shape[1] / block_size)
    heads = rearrange(torch.zeros(1, k.shape[2], q.shape[2] // k.shape[2], 1, 1), "b h g i j -> b (h g) i j")
    lines = torch.softmax(torch.arange(heads.shape[1] * n_b, dtype=torch.float32).view(1, -1, n_b), -1)
    score_cover_topk(lines, gamma)
    score_cover_topk(lines * 2, gamma)
    vertical = torch_bhn_sumpool(lines, 1)
    torch_bhn_sumpool(lines.flip(-1), 2)
    pooled = triton_bnhd_pool(k, block_size)[..., 0].mean(-1, keepdim=True).expand(1, n_b, heads.shape[1])
    aware = square_root_js_divergence(vertical, vertical + torch.arange(heads.shape[1]).view(1, -1, 1) / (8 * n_b)) < tau
    for b, h in aware.nonzero():
        score_cover_idx(torch.full((n_b * n_b,), float(h) + pooled.shape[1]), gamma * n_b)
    return [[torch.tensor([0, n_b + 1, 2 * n_b + h]) for h in range(heads.shape[1])]]

def flex_prefill_attention(q, k, v, gamma, tau=0, min_budget=None, max_budget=None,
                           gqa_interleave=False, softmax_scale=None, block_size=128,
                           return_computational_ratio=False):
    if q.shape[1] <= 2 * block_size:
        return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=True)
    block_idx = get_active_blocks(q, k, v, block_size, gamma, min_budget, max_budget, tau)
    return triton_block_wise_attention(q, k, v, block_idx, block_size, softmax_scale=softmax_scale)
'''


def test_flexprefill_reference_loader_records_what_the_code_computes(tmp_path):
    # A stand-in for the fetched repository (its file, with the names the loader takes),
    # whose selection is known: the loader's recorders and decoding are what is tested.
    path = tmp_path / "flex_prefill" / "ops" / "flex_prefill_attention.py"
    path.parent.mkdir(parents=True)
    path.write_text(FAKE_REFERENCE.replace("\ndef flex_prefill", "\n@torch.no_grad()\ndef flex_prefill"))
    ref = sr.load_flexprefill_reference(tmp_path)
    q, k = torch.randn(200, 4, 16), torch.randn(200, 2, 16)
    got = sr.flexprefill_reference_blocks(ref, q, k, gamma=0.9, tau=0.3, min_budget=32,
                                          max_budget=None, block=32)
    n_b = 7
    assert got["pairs"] == [{(0, 0), (1, 1), (2, h)} for h in range(4)]
    assert got["aware"] == [True, True, True, False]                 # distances 0, 1/8, 2/8, 3/8
    lines = torch.softmax(torch.arange(4 * n_b, dtype=torch.float32).view(4, n_b), -1)
    torch.testing.assert_close(got["vertical"], lines)
    torch.testing.assert_close(got["slash"], lines * 2)              # flipped back to distance order
    assert got["token_counts"][0].tolist() == [1000] * 4 and got["token_counts"][1].tolist() == [2000] * 4
    assert sorted(got["qa_scores"]) == [0, 1, 2]
    assert float(got["qa_scores"][2][0, 0]) == 2 + n_b and got["qa_scores"][2].shape == (n_b, n_b)
    # Its dense path for short prompts: every causal block, no pattern.
    dense = sr.flexprefill_reference_blocks(ref, q[:64], k[:64], gamma=0.9, tau=0.3, min_budget=32,
                                            max_budget=None, block=32)
    assert dense["aware"] is None and dense["pairs"][0] == {(0, 0), (1, 0), (1, 1)}


FLEXPREFILL_REF = os.environ.get("FLEXPREFILL_REF", "")


@pytest.mark.skipif(not (Path(FLEXPREFILL_REF) / "flex_prefill" / "ops" / "flex_prefill_attention.py").is_file(),
                    reason="set FLEXPREFILL_REF to a checkout of bytedance/FlexPrefill")
def test_flexprefill_reference_agrees_with_astreams_estimate_and_the_restated_rule():
    from astream.policies.flexprefill import FlexPrefillPolicy
    ref = sr.load_flexprefill_reference(Path(FLEXPREFILL_REF))
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(512, 8, 16, generator=gen), torch.randn(512, 2, 16, generator=gen)
    q[:, :4] *= 4.0                                                 # sharper heads diverge more
    probe = FlexPrefillPolicy(gamma=0.9, min_budget=64, block_size=32)
    js = sr.astream_flexprefill_blocks(probe, q, k, 0.25)["js"]
    policy = FlexPrefillPolicy(gamma=0.9, tau=float(js.median()) + 1e-6, min_budget=64, block_size=32)
    ours = sr.astream_flexprefill_blocks(policy, q, k, 0.25)
    theirs = sr.flexprefill_reference_blocks(ref, q, k, gamma=policy.gamma, tau=policy.tau,
                                             min_budget=policy.min_budget, max_budget=None, block=32)
    assert theirs["aware"] == ours["aware"] and 0 < sum(ours["aware"]) < 8
    for name in ("vertical", "slash", "js"):
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-5, rtol=1e-5)
    rule = sr.flexprefill_reference_rule(ours["vertical"], ours["slash"], ours["qa_scores"], ours["aware"],
                                         theirs["token_counts"], gamma=policy.gamma, min_blocks=2,
                                         max_blocks=None, n_b=16)
    assert rule == theirs["pairs"]
    assert all(16 < len(p) < 136 for p in theirs["pairs"])
