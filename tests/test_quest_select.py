"""CPU tests of Quest's page selection (astream.ops.quest_select): each reference step
against brute force, and the fused op's reference against them. Its Triton kernels
against these references: test_triton_quest_select."""

from __future__ import annotations

import pytest
import torch
from test_quest_ops import shuffled_tables

from astream.ops import quest
from astream.ops.kv_write import dequantize_ref, quantize_ref
from astream.ops.pages import with_newest_block
from astream.ops.quest_select import (
    page_scores_ref, physical_page_ids, select_decode_pages, select_decode_pages_ref, select_pages,
)

INF = float("inf")


def test_physical_page_ids():
    tables = torch.tensor([[5, 2, 9], [4, 10**6, 10**6]], dtype=torch.int32)
    ids, n = physical_page_ids(tables, torch.tensor([50, 7], dtype=torch.int32),
                                     max_pages=6, block_size=32, page_size=16)
    assert n.tolist() == [4, 1] and n.dtype == torch.int32
    assert ids.tolist() == [[10, 11, 4, 5, -1, -1], [8, -1, -1, -1, -1, -1]]


# ---- scores and selection ------------------------------------------------------------

def brute_scores(q, kmin, kmax, ids, num_pages, reduce):
    batch, heads, _ = q.shape
    kvh = kmin.shape[1]
    group = heads // kvh
    out = torch.full((batch, kvh, ids.shape[1]), -INF, dtype=torch.float64)
    for b in range(batch):
        valid = [p for p in range(min(int(num_pages[b]), ids.shape[1])) if ids[b, p] >= 0]
        per_head = {}
        for h in range(heads):
            qh = q[b, h].double()
            for p in valid:
                lo, hi = kmin[ids[b, p], h // group].double(), kmax[ids[b, p], h // group].double()
                per_head[h, p] = float(torch.maximum(qh * lo, qh * hi).sum())
        best = {h: max((per_head[h, p] for p in valid), default=-INF) for h in range(heads)}
        for g in range(kvh):
            for p in valid:
                mine = [per_head[h, p] for h in range(g * group, (g + 1) * group)]
                if reduce == "max":
                    out[b, g, p] = max(mine)
                elif reduce == "sum":
                    out[b, g, p] = sum(mine)
                else:       # relative: below the head's own best page, the nearest head's
                    out[b, g, p] = max(s - best[h] for s, h in zip(mine, range(g * group, (g + 1) * group)))
    return out


def random_bounds(pages, kvh, dim, seed, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(2, pages, kvh, dim, generator=gen)
    return torch.minimum(a, b).to(dtype), torch.maximum(a, b).to(dtype)


@pytest.mark.parametrize("reduce", quest.GQA_REDUCTIONS)
@pytest.mark.parametrize("group", [1, 4])
def test_page_scores_match_formula(reduce, group):
    kmin, kmax = random_bounds(40, 2, 16, seed=group)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(3, 2 * group, 16, generator=gen)
    ids = torch.randint(0, 40, (3, 9), generator=gen)
    ids[1, 2] = -1
    num_pages = torch.tensor([9, 5, 0], dtype=torch.int32)
    got = page_scores_ref(q, kmin, kmax, ids, num_pages, gqa_reduce=reduce)
    want = brute_scores(q, kmin, kmax, ids, num_pages, reduce)
    assert got.dtype == torch.float32 and got.shape == (3, 2, 9)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        page_scores_ref(q, kmin, kmax, ids, num_pages, gqa_reduce="mean")


def test_relative_keeps_every_query_heads_best_page_where_max_lets_one_head_take_all():
    """Query heads whose scores run ten times larger than their group's others: "max" fills
    the budget with their pages; "relative" ranks each head's best page first (it scores 0),
    so each head of the group keeps it."""
    gen = torch.Generator().manual_seed(3)
    kvh, group, dim, n_pages, budget = 2, 4, 32, 64, 2 + 4       # sink, recent, one per head
    kmin, kmax = random_bounds(n_pages, kvh, dim, seed=3, dtype=torch.float32)
    q = torch.randn(1, kvh * group, dim, generator=gen)
    q[0, ::group] *= 10
    ids = torch.arange(n_pages).view(1, -1)
    num = torch.tensor([n_pages], dtype=torch.int32)
    heads = brute_heads(q, kmin, kmax, n_pages)
    inner = heads[:, 1:-1].argmax(-1) + 1                           # each head's best, not forced
    for reduce in ("max", "relative"):
        idx, counts = select_pages(page_scores_ref(q, kmin, kmax, ids, num, gqa_reduce=reduce),
                                   num, budget)
        kept = [int(inner[h]) in idx[0, h // group, :counts[0, h // group]].tolist()
                for h in range(kvh * group)]
        if reduce == "relative":
            assert all(kept), kept
        else:                   # the large heads keep theirs, most of the others lose it
            assert all(kept[::group]) and sum(kept) < len(kept) // 2, kept


def brute_heads(q, kmin, kmax, n_pages):
    """[H, P] each query head's score of every page (ids = pages), in float64."""
    group = q.shape[1] // kmin.shape[1]
    lo, hi = (b.double().repeat_interleave(group, 1) for b in (kmin, kmax))    # [P, H, D]
    qd = q[0].double()
    return torch.maximum(qd * lo, qd * hi).sum(-1).T


def brute_select(scores, n, budget, sink, recent):
    if n <= budget:
        return list(range(n))
    keep = set(range(sink)) | set(range(n - recent, n))
    rest = sorted((p for p in range(n) if p not in keep), key=lambda p: -float(scores[p]))
    return sorted(keep | set(rest[:budget - len(keep)]))


@pytest.mark.parametrize("ties", [False, True])   # ties: few distinct scores, lowest page first
@pytest.mark.parametrize("sink,recent", [(1, 1), (2, 3), (0, 1)])
@pytest.mark.parametrize("width", [40, 6])  # 6 < budget: the padded-columns path
def test_select_pages_matches_bruteforce(sink, recent, width, ties):
    gen = torch.Generator().manual_seed(sink * 10 + recent)
    budget = 8
    num_pages = torch.tensor([0, 1, 3, 8, 9, 37, 40], dtype=torch.int32).clamp(max=width)
    scores = torch.randn(7, 3, width, generator=gen)
    if ties:
        scores = scores.mul(1.5).round()
    scores[5, 1, 4] = -INF  # a real page with a -inf score still outranks padding
    idx, counts = select_pages(scores, num_pages, budget, sink, recent)
    assert idx.shape == (7, 3, budget) and idx.dtype == counts.dtype == torch.int32
    for b in range(7):
        for h in range(3):
            want = brute_select(scores[b, h], int(num_pages[b]), budget, sink, recent)
            c = int(counts[b, h])
            assert c == len(want) and idx[b, h, :c].tolist() == want
            pad = want[-1] if want else 0
            assert idx[b, h, c:].tolist() == [pad] * (budget - c)


def test_select_pages_edge_cases():
    with pytest.raises(ValueError):
        select_pages(torch.zeros(1, 1, 4), torch.tensor([4]), 2, sink_pages=2)
    idx, counts = select_pages(torch.zeros(2, 3, 0), torch.tensor([0, 0]), 4)
    assert idx.shape == (2, 3, 4) and not idx.any() and not counts.any()


def test_planted_needle_is_selected():
    """A key aligned with the query in a middle page wins against random keys."""
    block, page, kvh, dim, n_pages = 32, 16, 2, 64, 64
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        keys = torch.randn(n_pages * page, kvh, dim, generator=gen)
        q = torch.randn(1, kvh * 4, dim, generator=gen)
        needle_page = int(torch.randint(8, 56, (1,), generator=gen))
        head = seed % (kvh * 4)
        keys[needle_page * page + 5, head // 4] = 3.0 * q[0, head]
        tables = torch.randperm(n_pages // 2, generator=gen).view(1, -1).int()
        tok = torch.arange(n_pages * page)
        slots = tables[0, tok // block].long() * block + tok % block
        kmin, kmax = quest.allocate_page_bounds(n_pages // 2, block, kvh, dim,
                                                dtype=torch.bfloat16, device="cpu")
        quest.update_page_bounds(kmin, kmax, keys.bfloat16(), slots)
        lens = torch.tensor([n_pages * page], dtype=torch.int32)
        ids, num = physical_page_ids(tables, lens, max_pages=n_pages, block_size=block)
        idx, counts = select_pages(page_scores_ref(q, kmin, kmax, ids, num, gqa_reduce="max"), num, 4)
        assert needle_page in idx[0, head // 4, :int(counts[0, head // 4])].tolist()




@pytest.mark.parametrize("reduce", quest.GQA_REDUCTIONS)
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_stored_bounds_pick_what_dequantized_bounds_pick(fp8, reduce):
    """An fp8 cache keeps the bounds of its stored keys (value / scale of their KV head):
    each head's scale multiplies all its group's scores of all its pages alike, so under
    every reduction the picks are those of the bounds of the dequantized keys."""
    block, page, kvh, dim, n_pages, budget = 32, 16, 4, 64, 96, 12
    gen = torch.Generator().manual_seed(5)
    scales = torch.tensor([0.02, 0.37, 1.0, 6.5])                 # per KV head, as calibrated
    stored = quantize_ref(torch.randn(n_pages * page, kvh, dim, generator=gen) * 3, scales, fp8)
    q = torch.randn(2, kvh * 2, dim, generator=gen)
    tables = torch.randperm(n_pages // 2, generator=gen).view(1, -1).int().expand(2, -1)
    tok = torch.arange(n_pages * page)
    slots = tables[0, tok // block].long() * block + tok % block
    picks = []
    dequantized = dequantize_ref(stored, scales, torch.float32)
    for keys, dtype in ((stored, fp8), (dequantized, torch.float32)):
        bounds = quest.allocate_page_bounds(n_pages // 2, block, kvh, dim, dtype=dtype, device="cpu")
        quest.update_page_bounds(*bounds, keys, slots)
        picks.append(select_decode_pages_ref(
            q, *bounds, tables, torch.tensor([n_pages * page, 40 * page], dtype=torch.int32),
            max_pages=n_pages, block_size=block, page_size=page, budget_pages=budget,
            gqa_reduce=reduce).indices)
    assert picks[0].dtype == torch.int32 and torch.equal(picks[0], picks[1])


# ---- the fused op ----------------------------------------------------------------------

def fused_case(lens, group=2, kvh=2, dim=16, block=32, page=16, seed=0, dtype=torch.float32):
    """Bounds of a random cache, shuffled block tables with garbage past each context."""
    gen = torch.Generator().manual_seed(seed)
    n_blocks = [-(-n // block) + 1 for n in lens]            # + the newest block's
    num_blocks = sum(n_blocks) + 3
    tables = shuffled_tables(n_blocks, num_blocks, gen)
    kmin, kmax = random_bounds(num_blocks * (block // page), kvh, dim, seed, dtype)
    q = torch.randn(len(lens), kvh * group, dim, generator=gen).to(dtype)
    return q, kmin, kmax, tables, torch.tensor(lens, dtype=torch.int32)


def test_fused_reference_is_the_steps_and_counts():
    q, kmin, kmax, tables, lens = fused_case([0, 64, 320, 800], seed=1)
    counters = torch.zeros(2, dtype=torch.int64)
    got = select_decode_pages_ref(q, kmin, kmax, tables, lens, max_pages=50, block_size=32,
                                  page_size=16, budget_pages=6, gqa_reduce="max",
                                  append_newest=True, physical=True, counters=counters)
    ids, num = physical_page_ids(tables, lens, max_pages=50, block_size=32)
    picks, counts = select_pages(page_scores_ref(q, kmin, kmax, ids, num, gqa_reduce="max"), num, 6)
    want = with_newest_block(picks, counts, lens, 32, 16)
    assert torch.equal(got.indices, want[0]) and torch.equal(got.counts, want[1])
    assert counters.tolist() == [int(counts.sum()), 8]
    blocks = tables.long().gather(1, (got.indices.long() // 2).flatten(1)).view_as(got.indices)
    assert torch.equal(got.physical, blocks * 2 + got.indices % 2)
    assert got.counts[0].tolist() == [2, 2]                  # no full block: the newest only
    assert got.indices[2, :, :8].max() < 20 + 2


def test_fused_op_dispatches_and_validates():
    q, kmin, kmax, tables, lens = fused_case([96], seed=2)
    kw = dict(max_pages=8, block_size=32, page_size=16)
    with pytest.raises(ValueError, match="budget_pages"):
        select_decode_pages(q, kmin, kmax, tables, lens, budget_pages=1, gqa_reduce="max", **kw)
    with pytest.raises(ValueError, match="gqa_reduce"):
        select_decode_pages(q, kmin, kmax, tables, lens, budget_pages=4, gqa_reduce="mean", **kw)
    got = select_decode_pages(q, kmin, kmax, tables, lens, budget_pages=4, gqa_reduce="max", **kw)
    assert got.physical is None and got.counts.tolist() == [[4, 4]]
