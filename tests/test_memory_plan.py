"""The memory plan (kvcache/sizing.py): where a cache's bytes go, from shapes alone. A
million tokens of the Qwen3-4B shape in fp8 with offload and Quest, planned on the CPU for
an 80 GiB GPU and a 125 GiB host, matches docs/ENGINE.md's formula and is accepted; the
engine logs its plan at start-up."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from astream.base.config import EngineConfig
from astream.executor.cache_plan import cache_spec
from astream.kvcache.sizing import MemoryAvailable, plan_cache, weight_bytes
from astream.models.config import ModelConfig
from astream.policies import QuestPolicy

GiB = 2**30
MILLION = 1 << 20
QWEN3_4B = dict(model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                tie_word_embeddings=True, max_position_embeddings=MILLION)
H100 = MemoryAvailable(device_free=80 * GiB, device_total=80 * GiB, host=120 * GiB)
CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def plan_million(max_num_seqs: int = 1, available: MemoryAvailable = H100, rank: int = 0,
                 device: torch.device = CUDA, policy: QuestPolicy = QuestPolicy(budget_tokens=4096),
                 **engine):
    model = ModelConfig.from_hf(QWEN3_4B)
    config = EngineConfig(offload=True, max_model_len=MILLION, max_num_seqs=max_num_seqs,
                          kv_cache_dtype="fp8_e4m3", max_num_batched_tokens=16384, **engine)
    # Weights are on the device when the engine plans: they count as used.
    weights = weight_bytes(model, torch.bfloat16)
    available = MemoryAvailable(available.device_free - weights, available.device_total,
                                available.host)
    plan = plan_cache(cache_spec(config, model, policy, 1, device, rank), model, torch.bfloat16,
                      device, torch.float8_e4m3fn, available)
    return model, plan


@pytest.mark.parametrize("max_num_seqs", [1, 64])
def test_a_million_fp8_tokens_of_qwen3_4b_with_offload_and_quest_follow_the_formula(max_num_seqs):
    model, plan = plan_million(max_num_seqs)
    mem = plan.memory
    token = 2 * 36 * 8 * 128                       # K and V bytes a token, all layers, fp8
    layer_block = token // 36 * 256                # one layer's K and V of a 256-token block
    assert plan.max_model_len == MILLION and plan.block_size == 256
    # One whole max_model_len sequence even past half the host (72 GiB of 120).
    assert plan.num_blocks == MILLION // 256 == 4096
    assert mem.host_pool == MILLION * token == 72 * GiB
    # Qwen3-4B's parameters in bf16, and the rotary tables of a million positions
    assert mem.weights == 4_022_468_096 * 2 + 2 * MILLION * 128 * 2
    assert mem.device_kv == 2 * 4096 * layer_block                     # the 2 dense layers
    # Page bounds (1/16 of KV) and group bounds (1/256) on the 34 sparse layers.
    assert mem.policy_metadata == pytest.approx(72 * GiB * 34 / 36 / 16 * 17 / 16, abs=1)
    assert mem.tails == 36 * (max_num_seqs + 1) * layer_block
    assert mem.staging == 2 * (16384 // 256 + 1) * layer_block
    assert mem.ring == 3 * plan.offload.slot_blocks * layer_block
    assert plan.offload.slot_blocks == 4096                           # one whole sequence
    assert mem.decode_buffers == mem.prefix_buffers == 0
    logits = max_num_seqs * 151936 * 16
    width = 4 * 2560 + (32 + 16) * 128
    assert mem.activations == (2 * 16384 * width + 3 * 8192 * 9728) * 2 + logits + 512 * 2**20
    # A prefill chunk after a prefix gathers a dense layer's whole million-token context: its
    # fp8 rows and their bf16 copy (6 GiB), more than a ring slot dequantized (4 GiB).
    assert mem.prefill_context == 4096 * (2 * layer_block + layer_block) == 6 * GiB
    # The decode graphs' sampling tables and workspace, a row per captured batch row.
    assert mem.graph_sampling == max_num_seqs * 151936 * (4 + 4 + 1 + 1 + 40)
    # Quest's two-level selection a step: float32 scores of the 4,096 groups per KV head and
    # query head ("relative"), each query head's scores of the 65 x 16 candidate pages (three
    # tensors), and the candidates' gathered bounds (2 bytes and float32, min and max); once
    # for the captured decode graphs' pool and once for an eager step.
    candidates = 65 * 16
    assert mem.decode_scratch == 2 * max_num_seqs * (4 * (4096 * (8 + 32) + candidates * 3 * 32)
                                                     + candidates * 2 * 8 * 128 * (2 + 4))
    assert mem.device_total == sum((mem.weights, mem.device_kv, mem.ring, mem.staging, mem.tails,
                                    mem.policy_metadata, mem.decode_scratch, mem.prefill_context,
                                    mem.graph_sampling, mem.activations))
    assert mem.device_total < 0.85 * 80 * GiB
    line = mem.describe()
    assert line.startswith("host pinned 72.00 GiB, device ") and "policy_metadata 4.52" in line


def test_keys_kept_on_the_device_are_half_the_selecting_layers_pool_and_still_fit():
    """A million fp8 tokens with Quest's keys_on_device: the 34 selecting layers' keys (34 GiB)
    join the device plan, the ring gives way, and the plan still fits an 80 GiB GPU."""
    _, plain = plan_million()
    _, keys = plan_million(policy=QuestPolicy(budget_tokens=4096, keys_on_device=True))
    layer_block = 2 * 8 * 128 * 256                   # one layer's fp8 K and V of a block
    assert plain.memory.device_keys == 0
    assert keys.memory.device_keys == 34 * 4096 * layer_block // 2 == 34 * GiB
    assert keys.offload.slot_blocks < plain.offload.slot_blocks
    assert keys.memory.device_total < 0.85 * 80 * GiB
    assert "device_keys 34.00" in keys.memory.describe()


def test_quest_scores_of_every_query_head_are_reserved_from_the_kv_cache():
    """Resident, 128K, 64 rows: "relative" scores every page per query head besides per KV
    head; the plan reserves those bytes, and the cache gives up the blocks they take."""
    model = ModelConfig.from_hf({**QWEN3_4B, "max_position_embeddings": 131072})
    config = EngineConfig(max_num_seqs=64, max_num_batched_tokens=8192)
    weights = weight_bytes(model, torch.bfloat16)
    available = MemoryAvailable(H100.device_free - weights, H100.device_total, H100.host)
    plans = {reduce: plan_cache(cache_spec(config, model, QuestPolicy(gqa_reduce=reduce), 2, CUDA),
                                model, torch.bfloat16, CUDA, torch.bfloat16, available)
             for reduce in ("relative", "max")}
    # Once for the decode graphs' pool (64 captured rows), once for an eager step.
    pages = 131072 // 16
    assert plans["max"].memory.decode_scratch == 2 * 64 * 4 * pages * 8
    assert plans["relative"].memory.decode_scratch == 2 * 64 * 4 * pages * (8 + 32)  # 160 MiB
    block = plans["max"].memory.device_kv // plans["max"].num_blocks
    extra = plans["relative"].memory.decode_scratch - plans["max"].memory.decode_scratch
    gave_up = plans["max"].num_blocks - plans["relative"].num_blocks
    overhead = QuestPolicy().kv_overhead(36, plans["max"].block_size)
    assert gave_up == pytest.approx(extra / (block * (1 + overhead)), abs=1)
    assert "decode_scratch 0.16" in plans["relative"].memory.describe()
    eager = cache_spec(EngineConfig(max_num_seqs=64, max_num_batched_tokens=8192, enforce_eager=True),
                       model, QuestPolicy(), 2, CUDA)
    assert eager.decode_scratch_bytes == 64 * 4 * pages * (8 + 32)                  # no graphs
    # Prefetch's selection (of prefetch x the budget's pages) runs beside a layer's own: in
    # one level both score every page; in two, the prefetch's candidates are 1.5x as many.
    shape = dict(num_heads=32, num_kv_heads=8, head_dim=128, rows=64, block_size=256)
    one = QuestPolicy().decode_scratch_bytes(max_context=131072, **shape)
    assert QuestPolicy(prefetch=1.5).decode_scratch_bytes(max_context=131072, **shape) == 2 * one
    groups, heads = 65536 // 16, 8 + 32
    two_level = {n: 64 * (4 * (groups * heads + n * 16 * 3 * 32) + n * 16 * 2 * 8 * 128 * 6)
                 for n in (65, 97)}                     # groups kept: 4 x 256 / 16 + 1, 4 x 384 / 16 + 1
    assert QuestPolicy().decode_scratch_bytes(max_context=MILLION, **shape) == two_level[65]
    assert QuestPolicy(prefetch=1.5).decode_scratch_bytes(max_context=MILLION, **shape) \
        == two_level[65] + two_level[97]
    # Where two levels hold less than one level over group_above_pages pages (many query heads
    # a KV head), a step under that many pages, which selects in one level, sets the figure.
    wide = dict(num_heads=64, num_kv_heads=1, head_dim=128, rows=1, block_size=256)
    assert QuestPolicy().decode_scratch_bytes(max_context=MILLION, **wide) == 4 * 16384 * 65
    # A context the budget covers never selects: nothing to reserve.
    assert QuestPolicy().decode_scratch_bytes(num_heads=32, num_kv_heads=8, head_dim=128, rows=64,
                                              max_context=4096, block_size=256) == 0


def test_a_million_token_sparse_prefill_plans_its_prefixes_and_fits():
    from astream.policies import CombinedPolicy, XAttentionPolicy
    model = ModelConfig.from_hf(QWEN3_4B)
    config = EngineConfig(offload=True, max_model_len=MILLION, max_num_seqs=1,
                          kv_cache_dtype="fp8_e4m3", max_num_batched_tokens=32768)
    policy = CombinedPolicy(XAttentionPolicy(), QuestPolicy(budget_tokens=4096))
    weights = weight_bytes(model, torch.bfloat16)
    available = MemoryAvailable(H100.device_free - weights, H100.device_total, H100.host)
    plan = plan_cache(cache_spec(config, model, policy, 1, CUDA), model, torch.bfloat16,
                      CUDA, torch.float8_e4m3fn, available)
    mem, layer_block = plan.memory, 2 * 8 * 128 * 256
    # Two packed bf16 prefixes of a million tokens (4 GiB each) and one staged fp8 piece.
    assert mem.prefix_buffers == 2 * 4096 * 2 * layer_block + 64 * layer_block
    assert mem.prefill_context == 6 * GiB and plan.offload.slot_blocks == 4096
    assert mem.device_total < 0.85 * 80 * GiB


def test_graph_sampling_is_planned_only_where_decode_graphs_sample():
    """The sampling tables and the tails' workspace are planned where decode graphs keep them:
    on CUDA unless enforce_eager, on one rank or tensor-parallel rank 0. The CPU captures no
    graph, and the other ranks capture no tail; nothing else in their plans changes."""
    plans = {name: plan_million(64, **engine)[1].memory for name, engine in (
        ("graphs", {}), ("eager", dict(enforce_eager=True)), ("capped", dict(cuda_graph_max_batch=16)),
        ("cpu", dict(device=CPU)), ("rank_1", dict(rank=1)))}
    assert plans["graphs"].graph_sampling == 64 * 151936 * 50
    assert plans["capped"].graph_sampling == 16 * 151936 * 50
    assert all(plans[name].graph_sampling == 0 for name in ("eager", "cpu", "rank_1"))
    assert replace(plans["rank_1"], graph_sampling=plans["graphs"].graph_sampling) == plans["graphs"]


def test_an_engine_on_the_cpu_plans_no_graph_sampling_and_builds_no_graphs(tiny_qwen3):
    from astream import LLM
    with LLM(str(tiny_qwen3), device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=512,
             kv_block_size=16) as llm:
        assert llm.core.plan.memory.graph_sampling == 0 and llm.core.runner.graphs is None


@pytest.mark.parametrize("offload", [False, True])
def test_an_engine_plans_its_quest_selections_scratch(tiny_qwen3, offload):
    """Through LLM, resident and offloaded: the plan holds what the bound policy says its
    selection takes for max_num_seqs rows of max_model_len (the CPU captures no graph, so
    once), more under "relative" than under "max", and nothing under Full."""
    from astream import LLM
    kw = dict(device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=512, kv_block_size=16,
              max_num_seqs=3, offload=offload)
    found = {}
    for name, policy in (("relative", QuestPolicy(budget_tokens=64)),
                         ("max", QuestPolicy(budget_tokens=64, gqa_reduce="max")), ("full", "full")):
        with LLM(str(tiny_qwen3), sparse_policy=policy, **kw) as llm:
            model = llm.core.runner.decoder.config
            found[name] = llm.core.plan.memory.decode_scratch
        if name != "full":
            assert found[name] == policy.decode_scratch_bytes(
                num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
                head_dim=model.head_dim, rows=3, max_context=512, block_size=16)
    assert found["relative"] > found["max"] > found["full"] == 0


def test_the_pool_stays_within_what_the_host_has():
    small = MemoryAvailable(80 * GiB, 80 * GiB, host=64 * GiB)
    with pytest.raises(ValueError, match="does not fit in the host KV pool"):
        plan_million(available=small)
    # Without an explicit max_model_len the pool keeps to half the host, as before.
    model = ModelConfig.from_hf(QWEN3_4B)
    config = EngineConfig(offload=True, max_num_seqs=1, kv_cache_dtype="fp8_e4m3")
    plan = plan_cache(cache_spec(config, model, QuestPolicy(), 1, CPU), model, torch.bfloat16,
                      CPU, torch.float8_e4m3fn, H100)
    assert plan.memory.host_pool <= 60 * GiB and plan.max_model_len < MILLION


def test_the_engine_logs_where_its_memory_goes(caplog):
    from astream import LLM
    with caplog.at_level(logging.INFO, logger="astream"):
        with LLM(device="cpu", dtype="float32", offload=True, kv_block_size=16, num_kv_blocks=64,
                 max_model_len=512, sparse_policy="quest"):
            pass
    lines = [r.getMessage() for r in caplog.records if "memory plan" in r.getMessage()]
    assert len(lines) == 1 and "host pinned" in lines[0] and "policy_metadata" in lines[0]


def test_every_device_field_of_the_memory_plan_counts_in_its_total():
    from dataclasses import fields

    from astream.kvcache.sizing import DEVICE_PARTS, MemoryPlan
    assert set(DEVICE_PARTS) == {f.name for f in fields(MemoryPlan)} - {"host_pool"}
    plan = MemoryPlan(**{name: 1 << i for i, name in enumerate(DEVICE_PARTS)}, host_pool=1 << 20)
    assert plan.device_total == (1 << len(DEVICE_PARTS)) - 1


def test_flexprefill_asks_for_prefill_chunks_its_estimate_wants_where_none_are_set():
    """FlexPrefill estimates each chunk from its last queries, so on CUDA an engine with
    max_num_batched_tokens unset prefills in its `chunk_tokens` (up to max_model_len),
    alone or combined with Quest; a set max_num_batched_tokens, chunk_tokens=0 and the CPU
    keep theirs."""
    from astream.policies import CombinedPolicy, FlexPrefillPolicy, FullPolicy
    model = ModelConfig.from_hf({**QWEN3_4B, "max_position_embeddings": 131072})
    weights = weight_bytes(model, torch.bfloat16)
    available = MemoryAvailable(H100.device_free - weights, H100.device_total, H100.host)

    def chunk(policy, device=CUDA, **engine) -> int:
        config = EngineConfig(**{"max_num_seqs": 4, **engine})
        return plan_cache(cache_spec(config, model, policy, 2, device), model, torch.bfloat16,
                          device, torch.bfloat16, available).max_num_batched_tokens

    flex = FlexPrefillPolicy()
    assert chunk(FullPolicy()) == 8192 and chunk(FullPolicy(), offload=True) == 16384
    assert chunk(flex) == chunk(flex, offload=True) == 32768
    assert chunk(CombinedPolicy(flex, QuestPolicy())) == 32768
    assert chunk(flex, max_model_len=20000) == 20000
    assert chunk(FlexPrefillPolicy(chunk_tokens=65536)) == 65536
    assert chunk(FlexPrefillPolicy(chunk_tokens=0)) == 8192
    assert chunk(flex, max_num_batched_tokens=4096) == 4096
    assert chunk(flex, device=CPU, cpu_kv_cache_gib=2.0, max_model_len=8192) == 2048
