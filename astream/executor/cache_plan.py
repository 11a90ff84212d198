"""How large a runner's KV cache is: the engine's settings, the sparse policy's device
overheads and the model's shape (one rank's shard under tensor parallelism) turned into a
CachePlan, after the weights are on the device."""

from __future__ import annotations

from astream.base.config import EngineConfig
from astream.kvcache.kv_format import KVFormat
from astream.kvcache.sizing import CachePlan, CacheSpec, plan_cache
from astream.models.config import ModelConfig
from astream.models.decoder import Decoder
from astream.policies import SparsePolicy


def plan_runner_cache(config: EngineConfig, decoder: Decoder, policy: SparsePolicy,
                      fmt: KVFormat) -> CachePlan:
    model = decoder.config
    overhead = _device_kv_overhead(policy, model.num_layers, config.offload)
    spec = _cache_spec(config, overhead, policy.sparse_prefill,
                       _decode_buffer_bytes(policy, model, config, fmt.element_size))
    return plan_cache(spec, model, decoder.dtype, decoder.device, fmt.dtype)


def _device_kv_overhead(policy: SparsePolicy, num_layers: int, offload: bool) -> float:
    """Device bytes per byte of KV in the cache beyond the cache itself: the policy's
    metadata (kept in the cache's element type) and, with offload, the layers whose KV it
    keeps on the device as well."""
    mirrored = len(policy.offload_device_layers(num_layers)) / num_layers if offload else 0.0
    return policy.kv_overhead(num_layers) + mirrored


def _decode_buffer_bytes(policy: SparsePolicy, model: ModelConfig, config: EngineConfig,
                         element_size: int) -> int:
    """Device bytes of the policy's per-row decode buffers on the offloaded layers."""
    if not config.offload:
        return 0
    tokens = policy.decode_buffer_tokens()
    if tokens >= (config.max_model_len or model.max_position_embeddings):   # never selects
        return 0
    layers = model.num_layers - len(policy.offload_device_layers(model.num_layers))
    per_token = model.kv_bytes_per_token // model.num_layers * element_size
    return tokens * config.max_num_seqs * layers * per_token


def _cache_spec(config: EngineConfig, kv_overhead: float, sparse_prefill: bool = False,
                device_reserve_bytes: int = 0) -> CacheSpec:
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
        kv_overhead=kv_overhead, whole_prefix=sparse_prefill and config.offload,
        device_reserve_bytes=device_reserve_bytes,
        host_ranks=config.ranks_per_node)
