"""benchmarks/sparse_reference.py's restatement of XAttention's reference selection, and the
one difference from astream's rule that docs/BENCHMARKS.md documents as intended."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
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
