"""Quest's two-level (grouped) page selection: against the one-level selection where the
groups cover the context, its invariants where they do not, the recall it keeps on keys
with structure, and through the engine (a covering selection gives the one-level tokens,
and Full's where the budget covers a sequence), resident and with offload."""

from __future__ import annotations

import pytest
import torch
from test_quest_select import fused_case

from astream.ops import quest
from astream.ops.quest_select import (
    group_budget, page_scores_ref, physical_page_ids, select_decode_pages_grouped,
    select_decode_pages_ref,
)

BLOCK, PAGE = 64, 16          # 4 pages a block


def group_bounds(kmin, kmax, group):
    """Bounds of groups of `group` physical pages, as the group bounds keep them."""
    shape = (kmin.shape[0] // group, group, *kmin.shape[1:])
    return kmin.view(shape).amin(1), kmax.view(shape).amax(1)


def without_block_zero(q, kmin, kmax, tables, lens):
    """The same cache with no sequence in block 0, whose pages get bounds wider than any
    real page's: where an op reads the ids it pads with (0) as a page, picks change."""
    ppb = BLOCK // PAGE
    used = {int(b) for row, n in zip(tables, lens) for b in row[:-(-int(n) // BLOCK) + 1]}
    spare = next(b for b in range(kmin.shape[0] // ppb) if b not in used)
    tables = torch.where(tables == 0, spare, tables)
    for bounds, wide in ((kmin, -50.0), (kmax, 50.0)):
        bounds[spare * ppb:(spare + 1) * ppb] = bounds[:ppb].clone()
        bounds[:ppb] = wide
    return q, kmin, kmax, tables, lens


def both(lens, budget, group, factor, seed, **kw):
    q, kmin, kmax, tables, lens = without_block_zero(*fused_case(lens, block=BLOCK, page=PAGE,
                                                                 seed=seed))
    args = dict(max_pages=int(lens.max()) // PAGE + BLOCK // PAGE, block_size=BLOCK,
                page_size=PAGE, budget_pages=budget, **kw)
    want = select_decode_pages_ref(q, kmin, kmax, tables, lens, **args)
    got = select_decode_pages_grouped(q, kmin, kmax, *group_bounds(kmin, kmax, group), tables, lens,
                                      group_pages=group, group_factor=factor, **args)
    return got, want, (q, kmin, kmax, tables, lens), args


@pytest.mark.parametrize("reduce", quest.GQA_REDUCTIONS)
@pytest.mark.parametrize("append,physical", [(False, True), (True, False)])
@pytest.mark.parametrize("group", [2, 4])
def test_groups_that_cover_the_context_pick_what_one_level_picks(group, append, physical, reduce):
    # 64 x budget 10 pages of candidates cover every context here.
    counters = [torch.zeros(2, dtype=torch.int64) for _ in range(2)]
    got, want, *_ = both([0, 64, 320, 1600, 3008], 10, group, 64, seed=group, sink_pages=1,
                         recent_pages=2, append_newest=append, physical=physical,
                         gqa_reduce=reduce)
    for a, b in zip(got, want):
        assert (a is None and b is None) or torch.equal(a, b)
    for i, selection in enumerate((got, want)):
        counters[i] += selection.counts.sum()
    assert torch.equal(counters[0], counters[1])


@pytest.mark.parametrize("reduce", quest.GQA_REDUCTIONS)
def test_a_few_groups_still_read_exactly_the_budget_with_the_sink_and_recent_pages(reduce):
    lens = [4032, 960, 100, 64]
    got, want, (q, kmin, kmax, tables, lens_t), args = both(
        lens, 12, 4, 1, seed=5, sink_pages=2, recent_pages=3, gqa_reduce=reduce, physical=True)
    assert torch.equal(got.counts, want.counts)          # min(pages, budget) for every row
    n_pages = [-(-n // PAGE) for n in lens]
    for b, h in ((b, h) for b in range(len(lens)) for h in range(got.counts.shape[1])):
        n = int(got.counts[b, h])
        picks = got.indices[b, h, :n].tolist()
        assert picks == sorted(set(picks)) and all(0 <= p < n_pages[b] for p in picks)
        if n_pages[b] > 12:
            assert {0, 1} | set(range(n_pages[b] - 3, n_pages[b])) <= set(picks)
        else:
            assert picks == list(range(n_pages[b]))
        assert got.indices[b, h, n:].tolist() == [picks[-1] if picks else 0] * (12 - n)
    blocks = tables.long().gather(1, (got.indices.long() // 4).flatten(1)).view_as(got.indices)
    assert torch.equal(got.physical, blocks * 4 + got.indices % 4)
    # Fewer pages scored: the groups, then their pages only.
    assert group_budget(12, 4, 1) * 4 < 4032 // PAGE


def test_grouped_selection_keeps_most_of_the_top_pages_on_keys_with_structure():
    """Keys drift slowly along the context (neighbouring pages alike, as real keys are) and a
    few planted runs match the query: the two levels find the planted pages, and keep most
    of the one-level picks."""
    gen = torch.Generator().manual_seed(3)
    tokens, kvh, dim = 16384, 2, 32
    walk = torch.randn(tokens // 256, kvh, dim, generator=gen).cumsum(0) * 0.3
    keys = walk.repeat_interleave(256, 0) + torch.randn(tokens, kvh, dim, generator=gen) * 0.5
    q = torch.randn(1, 2 * kvh, dim, generator=gen)
    planted = [1000, 5000, 9000, 15000]
    for start in planted:                       # 48 tokens that align with every query head
        keys[start:start + 48] = q.view(kvh, 2, dim).mean(1) * 3
    blocks = tokens // BLOCK
    kmin, kmax = quest.allocate_page_bounds(blocks + 1, BLOCK, kvh, dim, dtype=torch.float32,
                                            device="cpu")
    gmin, gmax = quest.allocate_page_bounds(blocks + 1, BLOCK, kvh, dim, dtype=torch.float32,
                                            device="cpu", page_size=PAGE * 4)
    slots = torch.arange(tokens)
    quest.update_page_bounds(kmin, kmax, keys, slots, PAGE)
    quest.update_page_bounds(gmin, gmax, keys, slots, PAGE * 4)
    assert torch.equal(torch.stack(group_bounds(kmin, kmax, 4)), torch.stack((gmin, gmax)))
    tables = torch.arange(blocks, dtype=torch.int32).view(1, -1)
    lens = torch.tensor([tokens], dtype=torch.int32)
    args = dict(max_pages=tokens // PAGE, block_size=BLOCK, page_size=PAGE, budget_pages=64,
                gqa_reduce="max")
    flat = select_decode_pages_ref(q, kmin, kmax, tables, lens, **args)
    recall = {}
    for factor in (1, 2, 4):
        two = select_decode_pages_grouped(q, kmin, kmax, gmin, gmax, tables, lens, group_pages=4,
                                          group_factor=factor, **args)
        recall[factor] = min(len(set(two.indices[0, h].tolist()) & set(flat.indices[0, h].tolist()))
                             / 64 for h in range(kvh))
    print(f"recall of the one-level picks by group_factor: {recall}")
    assert recall[1] < recall[2] <= recall[4] and recall[4] >= 0.9
    for start in planted:
        for h in range(kvh):
            assert set(range(start // PAGE + 1, (start + 48) // PAGE)) <= set(two.indices[0, h].tolist())


def test_groups_must_fit_a_block():
    q, kmin, kmax, tables, lens = fused_case([256], block=BLOCK, page=PAGE)
    with pytest.raises(ValueError, match="group_pages"):
        select_decode_pages_grouped(q, kmin, kmax, kmin, kmax, tables, lens, max_pages=16,
                                    block_size=BLOCK, page_size=PAGE, budget_pages=4,
                                    group_pages=8, group_factor=1, gqa_reduce="max")


def test_scores_of_the_second_level_are_the_page_scores():
    """The candidates' scores are page_scores_ref's: with groups covering the context the
    picks are the top pages by those scores (the one-level reference's ranking)."""
    got, _, (q, kmin, kmax, tables, lens), args = both([1024], 8, 4, 64, seed=9, sink_pages=0,
                                                       recent_pages=0, gqa_reduce="max")
    ids, num = physical_page_ids(tables, lens, max_pages=args["max_pages"], block_size=BLOCK)
    scores = page_scores_ref(q, kmin, kmax, ids, num, gqa_reduce="max")
    top = scores[0].topk(8, dim=-1).indices.sort(-1).values.int()
    assert torch.equal(got.indices[0], top)


# ---- through the engine ----------------------------------------------------------------

ENGINE = dict(device="cpu", dtype="float32", kv_block_size=64, num_kv_blocks=96, max_model_len=2048)


@pytest.fixture(scope="module")
def engine_full_tokens():
    from test_quest import GREEDY, LONG, SHORT

    from astream import LLM
    with LLM(**ENGINE) as llm:
        return [o.token_ids for o in llm.generate([LONG, *SHORT], GREEDY)]


@pytest.mark.parametrize("offload", [pytest.param(False, id="resident"),
                                     pytest.param(True, id="offload")])
def test_the_engine_with_two_levels_forced(engine_full_tokens, offload):
    """Groups forced on (group_above_pages=0): with groups that cover every context the
    tokens are one-level Quest's (and Full's for the prompts the budget covers); with few
    groups every selection still reads exactly the budget's pages."""
    from test_quest import GREEDY, LONG, SHORT

    from astream import LLM
    from astream.policies import QuestPolicy
    prompts = [LONG, *SHORT]
    runs = {}
    for name, policy, asked in (
            ("flat", QuestPolicy(budget_tokens=256, group_above_pages=10**6), prompts),
            ("covering", QuestPolicy(budget_tokens=256, group_pages=4, group_above_pages=0,
                                     group_factor=64), prompts),
            ("few", QuestPolicy(budget_tokens=128, group_pages=4, group_above_pages=0,
                                group_factor=1), [LONG])):
        with LLM(**ENGINE, offload=offload, sparse_policy=policy) as llm:
            runs[name] = ([o.token_ids for o in llm.generate(asked, GREEDY)], llm.stats())
    (flat, flat_stats), (covering, covering_stats) = runs["flat"], runs["covering"]
    assert sum(flat_stats["quest_selections"]) > 0
    assert covering == flat and covering[1:] == engine_full_tokens[1:]
    assert covering_stats["quest_pages_read"] == flat_stats["quest_pages_read"]
    few, stats = runs["few"]
    pages, rows = stats["quest_pages_read"], stats["quest_selections"]
    assert pages[:2] == rows[:2] == [0, 0]                                  # dense layers
    assert all(r > 0 and p == 8 * r for p, r in zip(pages[2:], rows[2:]))  # 128 / 16
    assert few[0][:2] == engine_full_tokens[0][:2]
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_group_parameters_are_checked():
    from astream.policies import QuestPolicy
    for bad in (dict(group_pages=3), dict(group_pages=0), dict(group_factor=0),
                dict(group_above_pages=-1)):
        with pytest.raises(ValueError, match="QuestPolicy group"):
            QuestPolicy(**bad)
    # Group bounds only where a block holds whole groups (16 pages of 16 tokens).
    assert QuestPolicy().kv_overhead(36, 256) == pytest.approx(34 / 36 / 16 * (1 + 1 / 16))
    assert QuestPolicy().kv_overhead(36, 128) == pytest.approx(34 / 36 / 16)
