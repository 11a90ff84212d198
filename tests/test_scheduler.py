"""Unit tests of the block manager and the scheduler (pure Python, no model)."""

from __future__ import annotations

import pytest

from astream.base.sampling import SamplingParams
from astream.core.scheduler import Scheduler, SchedulerConfig
from astream.core.sequence import Sequence, SequenceStatus
from astream.kvcache.block_manager import BlockManager

P = SamplingParams(max_tokens=8)


def seq(rid: str, tokens: list[int], arrival: int = 0) -> Sequence:
    return Sequence(rid, tokens, P, arrival)


def make_scheduler(blocks=16, block_size=4, max_seqs=4, budget=64, max_len=64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_seqs, budget, max_len), BlockManager(blocks, block_size))


def fake_sample(sched: Scheduler, batch, token: int = 7) -> None:
    """What the engine does after a step: append the sampled token."""
    for item in batch.items:
        if item.sample:
            item.seq.output_token_ids.append(token)
            sched.blocks.register_full_blocks(item.seq, item.seq.num_tokens)


# ---- block manager -------------------------------------------------------------------

def test_grow_and_release_return_every_block():
    bm = BlockManager(8, 4)
    s = seq("a", list(range(10)))
    bm.grow(s, 10)
    assert len(s.block_table) == 3 and bm.num_free == 5
    bm.release(s)
    assert bm.num_free == 8 and s.block_table == []


def test_grow_beyond_capacity_raises():
    bm = BlockManager(2, 4)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.grow(seq("a", list(range(9))), 9)


def test_prefix_cache_hit_requires_whole_prefix_and_leaves_one_token():
    bm = BlockManager(16, 4)
    a = seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.grow(a, 9)
    a.num_computed_tokens = 9
    bm.register_full_blocks(a, 9)
    b = seq("b", [1, 2, 3, 4, 5, 6, 7, 8])            # same 2 blocks, but must compute >= 1 token
    assert bm.reuse_cached_prefix(b) == 4
    assert b.block_table == a.block_table[:1]
    c = seq("c", [9, 2, 3, 4, 5, 6, 7, 8, 1])          # first block differs: chain breaks
    assert bm.reuse_cached_prefix(c) == 0
    d = seq("d", [1, 2, 3, 4, 5, 6, 7, 8, 0, 0])
    assert bm.reuse_cached_prefix(d) == 8
    assert bm.blocks[a.block_table[0]].ref_count == 3


def test_freed_cached_blocks_are_reused_until_evicted():
    bm = BlockManager(3, 4)
    a = seq("a", [1, 2, 3, 4, 5])
    bm.grow(a, 5)
    a.num_computed_tokens = 5
    bm.register_full_blocks(a, 5)
    cached_block = a.block_table[0]
    bm.release(a)
    assert bm.num_free == 3
    b = seq("b", [1, 2, 3, 4, 9])
    assert bm.reuse_cached_prefix(b) == 4 and b.block_table == [cached_block]
    bm.release(b)
    hog = seq("hog", list(range(100, 112)))
    bm.grow(hog, 12)                                     # takes every block, evicting the cached one
    bm.release(hog)
    assert bm.reuse_cached_prefix(seq("c", [1, 2, 3, 4, 9])) == 0


def test_uncached_blocks_are_allocated_before_cached_ones():
    bm = BlockManager(4, 4)
    a = seq("a", [1, 2, 3, 4])
    bm.grow(a, 4)
    a.num_computed_tokens = 4
    bm.register_full_blocks(a, 4)
    kept = a.block_table[0]
    bm.release(a)
    other = seq("x", list(range(12)))
    bm.grow(other, 12)
    assert kept not in other.block_table


def test_blocks_exist_only_once_handed_out_and_reuse_order_is_kept():
    bm = BlockManager(1_000_000, 4)
    assert bm.num_free == 1_000_000 and len(bm.blocks) == 0
    cached = seq("cached", [1, 2, 3, 4, 5])
    bm.grow(cached, 5)                                   # blocks 0, 1
    cached.num_computed_tokens = 5
    bm.register_full_blocks(cached, 5)                   # block 0 now holds a prefix
    scratch = seq("scratch", list(range(8)))
    bm.grow(scratch, 8)                                  # blocks 2, 3 (never hashed)
    bm.release(cached)
    bm.release(scratch)
    assert bm.num_free == 1_000_000 and len(bm.blocks) == 4
    taker = seq("taker", list(range(100, 124)))
    bm.grow(taker, 24)
    # a freed block with nothing to keep first, then its successors (one copy of many
    # blocks), never-used ones included; the cached prefix stays
    assert taker.block_table == [2, 3, 4, 5, 6, 7]
    other = seq("other", list(range(200, 208)))
    bm.grow(other, 8)
    assert other.block_table == [1, 8]
    assert bm.reuse_cached_prefix(seq("again", [1, 2, 3, 4, 9])) == 4


def test_blocks_come_in_ascending_runs_after_reuse():
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    first = seq("a", list(range(40)))
    bm.grow(first, 40)
    bm.release(first)
    second = seq("b", list(range(100)))
    bm.grow(second, 100)
    table = second.block_table
    breaks = sum(1 for x, y in zip(table, table[1:]) if y != x + 1)
    assert breaks <= 1, table        # at most one jump, from the reused run to the fresh one
    assert table[:10] == list(range(10))


# ---- scheduler -----------------------------------------------------------------------

def test_chunked_prefill_respects_token_budget():
    sched = make_scheduler(blocks=64, budget=8, max_seqs=4)
    s = seq("a", list(range(20)))
    sched.add(s)
    chunks = []
    while s.num_computed_tokens < 20:
        batch = sched.schedule()
        chunks.append(batch.items[0].num_tokens)
        assert batch.num_tokens <= 8
    assert chunks == [8, 8, 4]
    assert batch.items[0].sample


def test_prefill_chunks_prefer_their_step_and_fall_back_to_the_hard_alignment():
    # A decode row leaves 15 of the 16-token budget: the prompt's chunk is cut back to 8
    # (the preferred step) rather than 15, so its prefill parts keep repeating shapes.
    config = SchedulerConfig(4, 16, 256, align_chunks_to=4, prefer_chunks_of=8)
    sched = Scheduler(config, BlockManager(128, 4))
    running = seq("r", [1, 2, 3])
    sched.add(running)
    fake_sample(sched, sched.schedule())
    long = seq("l", list(range(40)), arrival=1)
    sched.add(long)
    chunks = []
    while long.num_computed_tokens < 40:
        batch = sched.schedule()
        chunks += [item.num_tokens for item in batch.items if item.seq is long]
        fake_sample(sched, batch)
    assert chunks == [8, 8, 8, 8, 8]
    # A budget below the preferred step still moves, on the hard alignment.
    tight = Scheduler(SchedulerConfig(1, 6, 256, align_chunks_to=2, prefer_chunks_of=8),
                      BlockManager(128, 4))
    alone = seq("t", list(range(20)))
    tight.add(alone)
    assert tight.schedule().items[0].num_tokens == 6


def test_running_sequences_decode_before_new_prefills():
    sched = make_scheduler(blocks=64, budget=6, max_seqs=4)
    a = seq("a", [1, 2, 3], 0)
    sched.add(a)
    fake_sample(sched, sched.schedule())
    b = seq("b", list(range(10)), 1)
    sched.add(b)
    batch = sched.schedule()
    assert [(i.seq.request_id, i.num_tokens) for i in batch.items] == [("b", 5), ("a", 1)]
    assert batch.admitted == (b,)                  # a was running already; b starts here
    assert sched.schedule().admitted == ()         # b's second chunk: running, not admitted


def test_max_num_seqs_bounds_running():
    sched = make_scheduler(blocks=64, max_seqs=2)
    for i in range(5):
        sched.add(seq(str(i), [1, 2, 3], i))
    batch = sched.schedule()
    assert len(batch.items) == 2 and len(sched.waiting) == 3


def test_preemption_frees_blocks_and_recompute_finishes_everything():
    sched = make_scheduler(blocks=6, block_size=4, max_seqs=4, budget=64, max_len=24)
    seqs = [seq(str(i), [i] * 6, i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    for _ in range(500):
        batch = sched.schedule()
        if batch is None:
            break
        fake_sample(sched, batch)
        for s in list(sched.running):
            if len(s.output_token_ids) >= 8:
                sched.finish(s)
    assert all(s.status is SequenceStatus.FINISHED for s in seqs)
    assert all(len(s.output_token_ids) == 8 for s in seqs)
    assert sched.preemptions > 0
    assert sched.blocks.num_free == 6


def test_prompt_at_max_model_len_is_rejected():
    sched = make_scheduler(max_len=8)
    with pytest.raises(ValueError, match=r"8 tokens.*max_model_len is 8"):
        sched.add(seq("a", list(range(8))))


def test_budget_smaller_than_max_num_seqs_is_rejected():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4, max_model_len=64)


def test_finish_of_waiting_and_running_sequences_releases_blocks():
    sched = make_scheduler(blocks=8, max_seqs=1)
    a, b = seq("a", [1, 2, 3], 0), seq("b", [4, 5, 6], 1)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.finish(b)
    sched.finish(a)
    sched.finish(a)                           # idempotent
    assert sched.blocks.num_free == 8 and not sched.has_work()
