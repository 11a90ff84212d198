"""Offloaded Quest decode steps from static buffers (what a CUDA graph replays): the same
tokens as the eager offload path, with padding rows, filled tails sent to the host after
the step, and every block returned. On the CPU the static program runs eagerly; on a GPU
the same program is captured (benchmarks/gpu_correctness.py and quest_decode.py run it)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from astream import LLM, SamplingParams
from astream.executor.offload_graphs import OffloadDecodeGraphs, selects_everywhere
from astream.executor.offload_plan import DecodeContext
from astream.policies import QuestPolicy

KW = dict(device="cpu", dtype="float32", kv_block_size=16, num_kv_blocks=384, max_model_len=2048,
          offload=True, max_num_seqs=4)
# About 700 tokens, so a 128-token budget reads a fraction of it; the short prompts have no
# full host block at first, and finish at different steps, so batches shrink and pad.
LONG = " ".join(f"Note {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7 % 97} stones."
                for i in range(60)) + " Which box holds the most stones?"
PROMPTS = [LONG, "The quick brown fox", "def fibonacci(n):", "1, 2, 3, 4,"]
PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 33, 20, 7)]


def quest(dense_layers: int = 2, reuse_pages: bool = False, prefetch: float = 0) -> QuestPolicy:
    return QuestPolicy(budget_tokens=128, dense_layers=dense_layers, reuse_pages=reuse_pages,
                       prefetch=prefetch)


def with_static_graphs(llm: LLM, max_batch: int) -> OffloadDecodeGraphs:
    runner, plan = llm.core.runner, llm.core.plan
    runner.graphs = OffloadDecodeGraphs(
        runner.decoder, runner.offload, runner.backends, runner.policy, runner.generator, max_batch=max_batch,
        max_blocks_per_seq=-(-plan.max_model_len // plan.block_size), max_context=plan.max_model_len)
    return runner.graphs


@pytest.mark.parametrize("dense_layers, reuse_pages, prefetch",
                         [(2, False, 0), (0, False, 0), (2, True, 0), (2, False, 1.5), (0, False, 1)])
def test_static_decode_steps_give_the_eager_offload_tokens(dense_layers, reuse_pages, prefetch):
    """With reuse_pages, static steps keep the pages in their rows' slots; with prefetch,
    they load them a layer early too; the eager steps they are compared with load every page."""
    with LLM(**KW, sparse_policy=quest(dense_layers)) as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    with LLM(**KW, sparse_policy=quest(dense_layers, reuse_pages, prefetch)) as llm:
        graphs = with_static_graphs(llm, max_batch=4)
        got = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
        stats = llm.stats()
        # The long prompt decodes 39 steps; all but one mixed with the others' prefill are
        # pure decode steps and ran from the buffers.
        assert stats["graph_steps"] == graphs.steps >= 38
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        assert stats["offload_tail_blocks_used"] == 0
        # 40 tokens after ~700 fill two or more tails; they reached the host and were read.
        assert stats["offload_bytes_offloaded"] > 0
        loaded, read = stats["quest_pages_loaded"], stats["quest_pages_read"]
        late = stats["quest_pages_loaded_late"]
        if prefetch:
            assert 0 < sum(late) < sum(read) / 2 and sum(loaded) > sum(late)
        else:
            assert sum(loaded) < sum(read) if reuse_pages else sum(loaded) == 0
    assert got == want


def test_a_covering_budget_with_prefetch_gives_full_offloads_tokens():
    """Static steps select on every offloaded layer whatever the context (the captured
    shape's longest context exceeds the budget); a budget that covers every sequence then
    picks every page, a layer early or late, and the tokens are Full offload's. Without
    late_fetch the layers read the prediction's pages (every page too) and load none; with
    reuse_pages as well, the prefetch loads only the pages a row's slots do not hold."""
    with LLM(**KW) as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    for late_fetch, reuse_pages in ((True, False), (False, False), (False, True)):
        policy = QuestPolicy(budget_tokens=1024, dense_layers=2, prefetch=1, late_fetch=late_fetch,
                             reuse_pages=reuse_pages)
        with LLM(**KW, sparse_policy=policy) as llm:
            graphs = with_static_graphs(llm, max_batch=4)
            got = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
            stats = llm.stats()
        assert graphs.steps >= 38 and sum(stats["quest_selections"]) > 0
        late = sum(stats["quest_pages_loaded_late"])
        early = sum(stats["quest_pages_loaded"]) - late
        assert early > 0 and (late < early if late_fetch else late == 0)
        if not late_fetch:              # every page held is read again the next step
            read = sum(stats["quest_pages_read"])
            assert early < read / 4 if reuse_pages else early == read
        assert got == want


def test_static_steps_pad_a_batch_to_a_captured_size():
    with LLM(**KW, sparse_policy=quest()) as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS[1:], PARAMS[1:])]
    with LLM(**KW, sparse_policy=quest()) as llm:
        with_static_graphs(llm, max_batch=4)           # 3 rows pad to 4, 2 to 2, 1 to 1
        assert [o.token_ids for o in llm.generate(PROMPTS[1:], PARAMS[1:])] == want


def test_only_a_policy_that_selects_on_every_offloaded_layer_is_captured():
    with LLM(**KW, sparse_policy=quest()) as llm:
        runner = llm.core.runner
        layers = runner.decoder.config.num_layers
        assert runner.graphs is None                   # nothing is captured on the CPU
        assert selects_everywhere(runner.policy, runner.offload, layers, 2048)
        assert not selects_everywhere(runner.policy, runner.offload, layers, 128)   # budget covers it
    with LLM(**KW) as llm:                             # Full reads everything through the ring
        runner = llm.core.runner
        assert not selects_everywhere(runner.policy, runner.offload, layers, 2048)


def with_dense_graphs(llm: LLM, max_batch: int, **kw) -> OffloadDecodeGraphs:
    runner, plan = llm.core.runner, llm.core.plan
    runner.graphs = OffloadDecodeGraphs(
        runner.decoder, runner.offload, runner.backends, runner.policy, runner.generator,
        max_batch=max_batch, max_blocks_per_seq=-(-plan.max_model_len // plan.block_size),
        max_context=plan.max_model_len, dense=True, **kw)
    return runner.graphs


def test_full_offload_steps_from_static_buffers_give_the_eager_ring_tokens():
    """Full with offload: each layer's whole host context copied into a ring slot at the
    chain's cuts, around the static program, gives the eager ring's tokens, moves the same
    bytes, returns every block."""
    with LLM(**KW) as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
        eager_loaded = llm.stats()["offload_bytes_loaded"]
    with LLM(**KW) as llm:
        graphs = with_dense_graphs(llm, max_batch=4)
        got = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
        stats = llm.stats()
        assert stats["graph_steps"] == graphs.steps >= 38
        assert stats["offload_bytes_loaded"] == eager_loaded > 0
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        assert stats["offload_tail_blocks_used"] == 0
    assert got == want


def test_dense_steps_whose_host_blocks_overflow_a_slot_run_eagerly():
    """A step whose host blocks do not fit one ring slot reads through the eager ring (over
    several jobs a layer); the others run from the static buffers, and the tokens are the
    eager ring's."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 33, 20, 12)]
    small_slots = dict(KW, offload_slot_tokens=512)
    with LLM(**small_slots) as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, params)]
        graphs = with_dense_graphs(llm, max_batch=4)
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
        # The long prompt's ~44 host blocks are over the 32 blocks of a slot (its decode
        # steps, ahead of the 32 of the longest request, run eagerly); once it is done, the
        # rest are not.
        assert 10 <= graphs.steps < 32
        stats = llm.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        slot_blocks = llm.core.runner.offload.slot_blocks
        assert slot_blocks == 32
        fits = [graphs._fits_a_slot(DecodeContext(None, None, None, 0, host_blocks=n))
                for n in (slot_blocks, slot_blocks + 1)]
        assert fits == [True, False]


# Greedy rows with penalties, a ban and logprobs: sampled by the tail after the step's graph.
PROCESSED = [SamplingParams(temperature=0, max_tokens=12, frequency_penalty=1.2, logprobs=3, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=12, repetition_penalty=2.0, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=12, min_tokens=12, presence_penalty=2.0, logprobs=0),
             SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)]


@pytest.mark.parametrize("dense", [False, True])
def test_offloaded_static_steps_sample_processed_rows_in_the_tail(dense):
    """Quest's one-graph steps and Full's chained steps: the tail samples rows with
    penalties, min_tokens and logprobs from the step's logits, as the eager offload path does."""
    def options():
        return dict(KW) if dense else dict(KW, sparse_policy=quest())

    with LLM(**options()) as llm:
        want = llm.generate(PROMPTS, PROCESSED)
        plain = llm.generate(PROMPTS, [replace(p, frequency_penalty=0.0, repetition_penalty=1.0,
                                               presence_penalty=0.0, min_tokens=0) for p in PROCESSED])
    # Each processed row's tokens differ from its plain greedy ones.
    assert all(w.token_ids != p.token_ids for w, p in zip(want[:3], plain[:3]))
    with LLM(**options()) as llm:
        graphs = (with_dense_graphs if dense else with_static_graphs)(llm, max_batch=4)
        got = llm.generate(PROMPTS, PROCESSED)
        assert graphs.steps >= 10 and graphs.sampler.sampled_inside == graphs.steps
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        for a, b in zip(g.logprobs or (), w.logprobs or ()):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
