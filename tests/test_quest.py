"""Quest through the engine, resident and with offload: same tokens as Full where its budget
covers a sequence, exactly its budget of pages where it does not, every block returned."""

from __future__ import annotations

import anyio
import pytest
import torch

from astream import LLM, Engine, SamplingParams
from astream.face.cli import _configs, build_parser
from astream.policies import QuestPolicy

KW = dict(device="cpu", dtype="float32", kv_block_size=16, num_kv_blocks=384, max_model_len=2048)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# About 700 tokens: long enough that a 256-token budget reads a third of it.
LONG = " ".join(f"Note {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7 % 97} stones."
                for i in range(60)) + " Which box holds the most stones?"
SHORT = ["The quick brown fox", "def fibonacci(n):", "1, 2, 3, 4,"]
MODES = [pytest.param(False, id="resident"), pytest.param(True, id="offload")]


@pytest.fixture(scope="module")
def full_tokens():
    with LLM(**KW) as llm:
        return [o.token_ids for o in llm.generate([LONG, *SHORT], GREEDY)]


def quest_llm(offload: bool, budget: int, dense_layers: int = 2, reuse_pages: bool = False,
              **engine) -> LLM:
    return LLM(**{**KW, **engine}, offload=offload,
               sparse_policy=QuestPolicy(budget_tokens=budget, dense_layers=dense_layers,
                                         reuse_pages=reuse_pages))


@pytest.mark.parametrize("offload", MODES)
def test_a_budget_that_covers_a_sequence_gives_fulls_tokens(full_tokens, offload):
    # The long prompt makes every sparse layer select; the short ones fit their budget.
    with quest_llm(offload, budget=256) as llm:
        outs = llm.generate([LONG, *SHORT], GREEDY)
        assert sum(llm.stats()["quest_selections"]) > 0
    assert [o.token_ids for o in outs[1:]] == full_tokens[1:]
    with quest_llm(offload, budget=4096) as llm:
        assert [o.token_ids for o in llm.generate([LONG, *SHORT], GREEDY)] == full_tokens


def test_a_small_budget_reads_exactly_its_pages_the_same_with_and_without_offload(full_tokens):
    results = {}
    for offload in (False, True):
        with quest_llm(offload, budget=128, dense_layers=2) as llm:
            out = llm.generate([LONG], GREEDY)[0]
            stats = llm.stats()
        results[offload] = out.token_ids
        pages, rows = stats["quest_pages_read"], stats["quest_selections"]
        assert pages[:2] == rows[:2] == [0, 0]                  # dense layers
        assert all(r > 0 and p == 8 * r for p, r in zip(pages[2:], rows[2:]))   # 128 / 16
        assert sum(ch.isalpha() for ch in out.text) > len(out.text) // 3, out.text
    assert results[False] == results[True]
    assert results[False][:2] == full_tokens[0][:2]


def test_offload_keeps_the_dense_layers_on_the_device_and_decodes_without_the_ring():
    """Quest's dense layers keep their KV on the device too, so with every sparse layer
    selecting, a decode step loads nothing through the ring; chunked prefill included."""
    with quest_llm(False, budget=128, dense_layers=3) as llm:
        want = llm.generate([LONG], GREEDY)[0].token_ids
    with quest_llm(True, budget=128, dense_layers=3, enable_prefix_caching=False,
                   max_num_batched_tokens=256) as llm:
        llm.generate([LONG], SamplingParams(temperature=0, max_tokens=1))
        one_token = llm.stats()["offload_bytes_loaded"]
        got = llm.generate([LONG], GREEDY)[0].token_ids
        stats = llm.stats()
    assert stats["offload_device_layers"] == [0, 1, 2]
    assert one_token > 0 and stats["offload_bytes_loaded"] == 2 * one_token
    assert got == want


def test_offload_steps_that_mix_sparse_decode_with_chunked_prefill_match_resident():
    """One sequence decodes (selecting pages) in the same steps as another's prefill chunks
    read their prefix through the ring: offload gives resident's tokens."""
    other = LONG.replace("stones", "pebbles")
    results = []
    for offload in (False, True):
        with quest_llm(offload, budget=128, max_num_batched_tokens=256) as llm:
            outs = llm.generate([LONG, other], GREEDY)
            assert sum(llm.stats()["quest_selections"]) > 0
        results.append([o.token_ids for o in outs])
    assert results[0] == results[1]


def test_reused_pages_give_the_same_tokens_and_load_fewer_pages():
    """With reuse_pages, an offloaded step reads its chosen pages where the step before left
    them: the same tokens as loading every page, fewer pages over PCIe. Sequences served
    one after another in the same row (blocks freed and reused) never read another's page."""
    prompts = [LONG, LONG.replace("stones", "pebbles"), LONG.replace("box", "crate")]
    results, stats = {}, {}
    for reuse in (False, True):
        with quest_llm(True, budget=128, reuse_pages=reuse, max_num_seqs=1,
                       enable_prefix_caching=False, num_kv_blocks=128) as llm:
            results[reuse] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
            stats[reuse] = llm.stats()
    assert results[True] == results[False]
    read, loaded = stats[True]["quest_pages_read"], stats[True]["quest_pages_loaded"]
    assert read == stats[False]["quest_pages_read"] and stats[False]["quest_pages_loaded"] == [0] * 30
    assert loaded[:2] == [0, 0] and all(0 < n < r for n, r in zip(loaded[2:], read[2:]))
    # Each sequence's first step loads all 8 of its pages a row and head; later steps less.
    assert all(n >= 3 * 8 * 3 for n in loaded[2:])           # 3 sequences x 3 KV heads


def test_reused_pages_in_a_batch_match_loading_every_page():
    """A batch of sequences decoding beside others' prefill chunks; and the decode policy of
    a combined policy reuses its pages too."""
    prompts = [LONG, LONG.replace("stones", "pebbles"), *SHORT]
    results = []
    for policy in ("quest(budget_tokens=128)", "quest(budget_tokens=128,reuse_pages=true)",
                   "xattention(threshold=1.0)+quest(budget_tokens=128,reuse_pages=true)"):
        with LLM(**KW, offload=True, sparse_policy=policy, max_num_batched_tokens=256) as llm:
            results.append([o.token_ids for o in llm.generate(prompts, GREEDY)])
            stats = llm.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        loaded, read = sum(stats["quest_pages_loaded"]), sum(stats["quest_pages_read"])
        assert (0 < loaded < read) if "reuse" in policy else loaded == 0
    assert results[0] == results[1]


def test_prefetched_pages_give_plain_quests_tokens_and_load_most_pages_a_layer_early():
    """prefetch=1.5: each sparse layer's pages, predicted from the layer before, load into
    its page buffers before it selects; it reads exactly what plain Quest reads (the same
    tokens), loads only the missed pages itself, and the dense layers prefetch nothing."""
    prompts = [LONG, LONG.replace("stones", "pebbles"), *SHORT]
    results, stats = {}, {}
    for prefetch in (0, 1.5):
        with LLM(**KW, offload=True, max_num_batched_tokens=256, sparse_policy=QuestPolicy(
                budget_tokens=128, dense_layers=2, prefetch=prefetch)) as llm:
            results[prefetch] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
            stats[prefetch] = llm.stats()
    assert results[1.5] == results[0]
    read, late = stats[1.5]["quest_pages_read"], stats[1.5]["quest_pages_loaded_late"]
    early = [a - b for a, b in zip(stats[1.5]["quest_pages_loaded"], late)]
    assert read == stats[0]["quest_pages_read"] and stats[0]["quest_pages_loaded"] == [0] * 30
    assert early[:2] == late[:2] == [0, 0]                  # the dense layers
    assert all(e > 0 for e in early[2:])                    # layer 1 predicts layer 2, and on
    # The early query names most pages: the layers load under half of what they read.
    assert sum(late) < 0.5 * sum(read)
    assert stats[1.5]["kv_blocks_free"] == stats[1.5]["kv_blocks_total"]


def test_keys_on_the_device_give_plain_quests_tokens_and_only_values_come_from_the_host(monkeypatch):
    """keys_on_device: every selecting layer's keys are copied to the device as they leave for
    the host, and its pages are gathered with keys from that copy, values from the pool."""
    from astream.kvcache import offload_engine
    prompts = [LONG, LONG.replace("stones", "pebbles"), *SHORT]
    results, sources, sent = {}, [], set()
    gather, to_host = offload_engine.gather_pages, offload_engine.OffloadEngine._copy_to_host
    monkeypatch.setattr(offload_engine, "gather_pages",
                        lambda k, v, *rest, **kw: (sources.append((k, v)), gather(k, v, *rest, **kw))[1])

    def copy_to_host(engine, layer, run, k, v):
        sent.update((layer, block) for block in range(run.dst, run.dst + run.count))
        to_host(engine, layer, run, k, v)
    monkeypatch.setattr(offload_engine.OffloadEngine, "_copy_to_host", copy_to_host)
    for keys in (False, True):
        with LLM(**KW, offload=True, max_num_batched_tokens=256, sparse_policy=QuestPolicy(
                budget_tokens=128, dense_layers=2, keys_on_device=keys)) as llm:
            results[keys] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
            engine, plan = llm.core.runner.offload, llm.core.plan
            if keys:
                assert [k is None for k in engine.device_k] == [True, True] + [False] * 28
                layer_block = engine.host_k[2][0].numel() * engine.host_k[2].element_size()
                assert plan.memory.device_keys == 28 * plan.num_blocks * layer_block
                assert any(layer == 5 for layer, _ in sent) and all(
                    torch.equal(engine.device_k[layer][block], engine.host_k[layer][block])
                    for layer, block in sent if layer >= 2)
                assert sources and all(
                    any(k is engine.device_k[layer] for layer in range(2, 30)) and
                    any(v is engine.host_v[layer] for layer in range(2, 30)) for k, v in sources)
            else:
                assert engine.device_k == [None] * 30 and plan.memory.device_keys == 0
                sources.clear()
    assert results[True] == results[False]
    with pytest.raises(ValueError, match="keys_on_device .* needs offload=True"):
        Engine.check_options(sparse_policy=QuestPolicy(keys_on_device=True))
    with pytest.raises(ValueError, match="keys_on_device must be True or False"):
        QuestPolicy(keys_on_device=1)
    assert Engine.check_options(sparse_policy="xattention+quest(keys_on_device=True)", offload=True)


def test_a_wrong_prediction_costs_loads_never_tokens(monkeypatch):
    """The prediction only decides what loads early: with a random early query the tokens
    are plain Quest's, and the layers load more pages themselves."""
    from astream.models.decoder import Decoder

    def random_query(self, layer, hidden, positions):
        cfg = self.config
        return torch.randn(hidden.shape[0], cfg.num_heads, cfg.head_dim, dtype=hidden.dtype)

    policy = QuestPolicy(budget_tokens=128, dense_layers=2, prefetch=1)
    late = {}
    for wrong in (False, True):
        if wrong:
            monkeypatch.setattr(Decoder, "early_query", random_query)
        with LLM(**KW, offload=True, sparse_policy=policy) as llm:
            tokens = llm.generate([LONG], GREEDY)[0].token_ids
            late[wrong] = sum(llm.stats()["quest_pages_loaded_late"])
        if not wrong:
            want = tokens
    assert tokens == want
    assert late[True] > late[False]


def test_without_late_fetch_layers_read_the_predicted_pages_and_load_nothing_themselves(full_tokens):
    """late_fetch=False: each sparse layer reads the pages its early query chose a layer
    ahead (prefetch x budget of them) and neither selects nor loads any itself. A prediction
    as wide as the context reads every page, and gives Full's tokens. With reuse_pages the
    same pages are read, and only those a row's slots did not hold load."""
    def run(prefetch: float, reuse_pages: bool = False):
        with LLM(**KW, offload=True, sparse_policy=QuestPolicy(
                budget_tokens=128, dense_layers=2, prefetch=prefetch, late_fetch=False,
                reuse_pages=reuse_pages)) as llm:
            return llm.generate([LONG], GREEDY)[0].token_ids, llm.stats()

    for prefetch in (1, 8):
        tokens, stats = run(prefetch)
        read, rows = stats["quest_pages_read"], stats["quest_selections"]
        assert stats["quest_pages_loaded_late"] == [0] * 30
        assert rows[:2] == [0, 0] and all(r > 0 for r in rows[2:])
        if prefetch == 1:               # the prediction's 8 pages of 16 tokens, not more
            assert all(p == 8 * r for p, r in zip(read[2:], rows[2:]))
        else:                           # 64 pages asked of a context of ~44 full pages
            assert all(p > 40 * r for p, r in zip(read[2:], rows[2:]))
            assert tokens == full_tokens[0]
        assert stats["quest_pages_loaded"] == read
        reused_tokens, reused = run(prefetch, reuse_pages=True)
        assert reused_tokens == tokens and reused["quest_pages_read"] == read
        loaded = reused["quest_pages_loaded"]
        assert loaded[:2] == [0, 0] and all(0 < n < p for n, p in zip(loaded[2:], read[2:]))
    with pytest.raises(ValueError, match="late_fetch=False .* needs prefetch"):
        QuestPolicy(late_fetch=False)


def test_page_buffers_are_counted_in_the_device_plan():
    from astream.base.config import EngineConfig
    from astream.executor.cache_plan import _decode_buffer_bytes
    from astream.models.config import ModelConfig

    model = ModelConfig.from_hf(dict(model_type="qwen3", vocab_size=100, hidden_size=256,
                                     intermediate_size=512, num_hidden_layers=10,
                                     num_attention_heads=8, num_key_value_heads=2, head_dim=64))
    config = EngineConfig(offload=True, max_num_seqs=3)
    reuse = QuestPolicy(budget_tokens=512, dense_layers=2, reuse_pages=True)
    # 8 offloaded layers x 3 rows x 512 tokens x (K + V: 2 x 2 heads x 64) x 2 bytes
    assert _decode_buffer_bytes(reuse, model, config, 2) == 8 * 3 * 512 * 256 * 2
    assert _decode_buffer_bytes(QuestPolicy(budget_tokens=512), model, config, 2) == 0
    assert _decode_buffer_bytes(reuse, model, EngineConfig(max_num_seqs=3), 2) == 0
    # A budget that every context fits never selects: nothing to keep.
    wide = QuestPolicy(budget_tokens=3072, reuse_pages=True)
    assert _decode_buffer_bytes(wide, model, config, 2) > 0          # the model's 4,096 positions
    short = EngineConfig(offload=True, max_num_seqs=3, max_model_len=2048)
    assert _decode_buffer_bytes(wide, model, short, 2) == 0
    assert _decode_buffer_bytes(QuestPolicy(budget_tokens=1 << 40, reuse_pages=True), model, config, 2) == 0
    # prefetch=1.5 holds 1.5 x the budget's pages (48 of 16 tokens), with or without reuse_pages,
    # also where that exceeds the context while the budget does not.
    for reuse_pages in (False, True):
        ahead = QuestPolicy(budget_tokens=512, dense_layers=2, prefetch=1.5, reuse_pages=reuse_pages)
        assert _decode_buffer_bytes(ahead, model, config, 2) == 8 * 3 * 768 * 256 * 2
    ahead = QuestPolicy(budget_tokens=3072, dense_layers=2, prefetch=1.5)
    assert _decode_buffer_bytes(ahead, model, config, 2) == 8 * 3 * 4608 * 256 * 2


def test_blocks_come_back_after_preemption_prefix_hits_and_cancels_with_quest():
    prompts = [f"Count slowly from {i} to {i + 30}:" for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with quest_llm(False, budget=32) as roomy:
        expected = [o.token_ids for o in roomy.generate(prompts, params)]
    small = LLM(**{**KW, "num_kv_blocks": 12, "max_model_len": 128},
                sparse_policy=QuestPolicy(budget_tokens=32))
    with small:
        assert [o.token_ids for o in small.generate(prompts, params)] == expected
        assert small.stats()["preemptions"] > 0 and small.stats()["kv_blocks_free"] == 12
    with quest_llm(True, budget=64) as llm:
        first = llm.generate([LONG], GREEDY)[0].token_ids
        hits = llm.stats()["prefix_cache_hits"]
        assert llm.generate([LONG], GREEDY)[0].token_ids == first
        assert llm.stats()["prefix_cache_hits"] > hits
        assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
@pytest.mark.parametrize("offload", MODES)
@pytest.mark.anyio
async def test_cancel_and_abort_return_every_block_with_quest(offload):
    async with Engine(**KW, offload=offload, sparse_policy="quest", sparse_budget=64) as engine:
        idle = engine.stats()["kv_blocks_free"]
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

        async def cut_after(n: int, request_id: str, abort: bool) -> None:
            count = 0
            async for _ in engine.stream(LONG, params, request_id=request_id):
                count += 1
                if count == n and abort:
                    await engine.abort(request_id)
                if count == n and not abort:
                    break

        async with anyio.create_task_group() as group:
            group.start_soon(cut_after, 3, "a", True)
            group.start_soon(cut_after, 5, "b", False)
        with anyio.fail_after(20):
            while engine.stats()["kv_blocks_free"] != idle or engine.stats()["requests"]:
                await anyio.sleep(0.01)


@pytest.mark.parametrize("spec, rule, other", [("quest", "relative", "max"),
                                                ("quest(gqa_reduce=max)", "max", "relative")])
def test_the_engine_selects_by_the_default_or_the_named_gqa_reduction(monkeypatch, spec, rule, other):
    """Under a small budget every selection the engine makes is the rule's ("relative" by
    default, or the one a spec names), and many differ from what the other would pick."""
    from astream.ops.quest_select import select_decode_pages_ref
    from astream.policies.quest.policy import QuestRuntime

    calls = []
    select = QuestRuntime.select_decode

    def recording(runtime, layer, query):
        chosen = select(runtime, layer, query)
        inputs = (query.q, *runtime.bounds[layer], query.block_tables, query.context_lens)
        calls.append(([t.clone() for t in inputs], query, chosen.indices.clone(),
                      chosen.counts.clone()))
        return chosen

    monkeypatch.setattr(QuestRuntime, "select_decode", recording)
    with LLM(**KW, sparse_policy=spec, sparse_budget=128) as llm:
        llm.generate([LONG], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(calls) == 2 * 28                          # 2 decode steps x the sparse layers
    differs = 0
    for inputs, query, indices, counts in calls:
        want = {}
        for reduce in (rule, other):
            picks = select_decode_pages_ref(
                *inputs, max_pages=-(-query.max_context // 16), block_size=16, page_size=16,
                budget_pages=8, gqa_reduce=reduce, append_newest=query.append_newest)
            want[reduce] = picks.indices[..., :picks.counts.max()]
        got = indices[..., :counts.max()]
        assert torch.equal(got, want[rule])
        differs += not torch.equal(got, want[other])
    assert differs > len(calls) // 2, differs


@pytest.mark.parametrize("kwargs, message", [
    (dict(sparse_policy="quest", sparse_budget=8), "budget_tokens"),
    (dict(sparse_policy="nosuch"), "unknown sparse_policy 'nosuch'"),
    (dict(sparse_policy="full", sparse_budget=1024), "takes no budget"),
    (dict(sparse_policy=QuestPolicy(), sparse_budget=1024), "instance carries its own"),
])
def test_bad_policy_options_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Engine(**KW, **kwargs)


@pytest.mark.parametrize("bad", [dict(page_size=12), dict(budget_tokens=0), dict(gqa_reduce="mean"),
                                 dict(dense_layers=-1), dict(reuse_pages="yes"),
                                 dict(late_fetch=0, prefetch=1)])
def test_quest_parameters_are_checked(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        QuestPolicy(**bad)


def test_the_cli_takes_a_policy_and_a_budget():
    args = build_parser().parse_args(["serve", "--sparse-policy", "quest", "--sparse-budget", "2048"])
    engine_kw, _ = _configs(args)
    assert (engine_kw["sparse_policy"], engine_kw["sparse_budget"]) == ("quest", 2048)
    with pytest.raises(ValueError, match="unknown sparse_policy"):
        _configs(build_parser().parse_args(["serve", "--sparse-policy", "quets"]))


def test_reuse_pages_or_prefetch_without_offload_is_an_error_not_a_no_op():
    from astream import Engine
    with pytest.raises(ValueError, match="reuse_pages and prefetch .* need offload=True"):
        Engine.check_options(sparse_policy=QuestPolicy(reuse_pages=True))
    with pytest.raises(ValueError, match="need offload=True"):
        Engine.check_options(sparse_policy=QuestPolicy(prefetch=1.5))
    with pytest.raises(ValueError, match="reuse_pages"):
        Engine.check_options(sparse_policy="xattention+quest(reuse_pages=True)")
    assert Engine.check_options(sparse_policy=QuestPolicy(reuse_pages=True), offload=True).offload
    assert Engine.check_options(sparse_policy="quest(prefetch=1.5)", offload=True).offload


@pytest.mark.parametrize("value", [0.5, -1, 9, True, "1.5"])
def test_a_prefetch_that_is_not_off_or_a_budget_multiple_is_refused(value):
    with pytest.raises(ValueError, match="prefetch must be 0"):
        QuestPolicy(prefetch=value)
