"""How large a runner's KV cache is: the engine's settings, the sparse policy's device
overheads and the model's shape (one rank's shard under tensor parallelism) turned into a
CachePlan, after the weights are on the device."""

from __future__ import annotations

import logging

import torch

from astream.base.config import EngineConfig
from astream.executor.build import captures_graphs, graph_sampling_rows, max_graph_batch
from astream.kvcache.kv_format import KVFormat
from astream.kvcache.sizing import CachePlan, CacheSpec, plan_cache
from astream.models.config import ModelConfig
from astream.models.decoder import Decoder
from astream.policies import SparsePolicy

log = logging.getLogger("astream")


def plan_runner_cache(config: EngineConfig, decoder: Decoder, policy: SparsePolicy,
                      fmt: KVFormat) -> CachePlan:
    model = decoder.config
    spec = cache_spec(config, model, policy, fmt.element_size, decoder.device, decoder.rank)
    plan = plan_cache(spec, model, decoder.dtype, decoder.device, fmt.dtype)
    log.info("astream: memory plan: %s", plan.memory.describe())
    return plan


def cache_spec(config: EngineConfig, model: ModelConfig, policy: SparsePolicy,
               kv_element_size: int, device: torch.device, rank: int = 0) -> CacheSpec:
    """The cache an engine with `config` and `policy` asks for on `device`, as tensor-parallel
    rank `rank` (plan it with plan_cache): the policy's device metadata (kept in the cache's
    element type, per byte of KV), with offload the layers whose KV it keeps on the device as
    well and its decode buffers, what its decode selection holds at once, and the decode
    graphs' sampling tables, and the prefill chunk its sparse prefill method asks for."""
    device_layers = len(policy.offload_device_layers(model.num_layers)) if config.offload else 0
    key_layers = len(policy.offload_key_layers(model.num_layers)) if config.offload else 0
    return _cache_spec(config, policy.kv_overhead(model.num_layers, config.block_size), policy.sparse_prefill,
                       _decode_buffer_bytes(policy, model, config, kv_element_size), device_layers,
                       graph_sampling_rows(config, device, rank), key_layers,
                       _decode_scratch_bytes(policy, model, config, device),
                       policy.prefill_chunk_tokens())


def _decode_buffer_bytes(policy: SparsePolicy, model: ModelConfig, config: EngineConfig,
                         element_size: int) -> int:
    """Device bytes of the policy's per-row decode buffers on the offloaded layers."""
    if not config.offload:
        return 0
    tokens = policy.decode_buffer_tokens(config.max_model_len or model.max_position_embeddings)
    layers = model.num_layers - len(policy.offload_device_layers(model.num_layers))
    per_token = model.kv_bytes_per_token // model.num_layers * element_size
    return tokens * config.max_num_seqs * layers * per_token


def _decode_scratch_bytes(policy: SparsePolicy, model: ModelConfig, config: EngineConfig,
                          device: torch.device) -> int:
    """What the policy's decode selection holds at once, for max_num_seqs rows of up to
    max_model_len tokens (the model's context where unset: the plan may shrink that later).
    Where decode steps are captured, the graphs' pool keeps the captured batch's for good
    and an eager step (a prefill beside decodes) allocates its own: both count."""
    def scratch(rows: int) -> int:
        return policy.decode_scratch_bytes(
            num_heads=model.num_heads, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
            rows=rows, max_context=config.max_model_len or model.max_position_embeddings,
            block_size=config.block_size)

    captured = scratch(max_graph_batch(config)) if captures_graphs(config, device) else 0
    return scratch(config.max_num_seqs) + captured


def _cache_spec(config: EngineConfig, kv_overhead: float, sparse_prefill: bool = False,
                device_reserve_bytes: int = 0, device_layers: int = 0,
                graph_rows: int = 0, key_layers: int = 0, decode_scratch_bytes: int = 0,
                prefill_chunk_tokens: int = 0) -> CacheSpec:
    """Under tensor parallelism each rank plans its own shard's cache: its share of
    `offload_host_gib`, and of this host's RAM with the other ranks that pin pools in it."""
    ranks = config.tensor_parallel_size
    host_gib = None if config.offload_host_gib is None else config.offload_host_gib / ranks
    return CacheSpec(
        block_size=config.block_size, max_num_seqs=config.max_num_seqs, offload=config.offload,
        max_model_len=config.max_model_len, max_num_batched_tokens=config.max_num_batched_tokens,
        num_kv_blocks=config.num_kv_blocks, gpu_memory_utilization=config.gpu_memory_utilization,
        cpu_kv_cache_gib=config.cpu_kv_cache_gib, offload_host_gib=host_gib,
        offload_ring_slots=config.offload_ring_slots, offload_slot_tokens=config.offload_slot_tokens,
        kv_overhead=kv_overhead, device_layers=device_layers, device_key_layers=key_layers,
        whole_prefix=sparse_prefill and config.offload,
        device_reserve_bytes=device_reserve_bytes, decode_scratch_bytes=decode_scratch_bytes,
        prefill_chunk_tokens=prefill_chunk_tokens,
        host_ranks=config.ranks_per_node, graph_sampling_rows=graph_rows)
