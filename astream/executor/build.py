"""Assemble a ModelRunner with its KV backend: the device paged cache (and CUDA graphs),
or the host pool behind the OffloadEngine. Attention kernels are chosen and the sparse
policy is bound to the cache here, once."""

from __future__ import annotations

import torch

from astream.config import EngineConfig
from astream.executor.cuda_graphs import DecodeGraphs
from astream.executor.offload_plan import TailSlots
from astream.executor.runner import ModelRunner
from astream.kvcache.offload_engine import OffloadEngine
from astream.kvcache.paged_cache import PagedKVCache
from astream.kvcache.sizing import CachePlan
from astream.models.decoder import Decoder
from astream.ops.backends import AttentionBackends
from astream.policies import KVLayout, SparsePolicy
from astream.runtime.device import DeviceRuntime


def build_runner(config: EngineConfig, plan: CachePlan, decoder: Decoder, runtime: DeviceRuntime,
                 policy: SparsePolicy) -> ModelRunner:
    dtype, device, model = decoder.dtype, runtime.device, decoder.config
    backends = AttentionBackends.select(device, dtype, model.head_dim)
    # The resident cache has one scratch block past its last (CUDA-graph padding writes there).
    layout = KVLayout(model.num_layers, model.num_heads, model.num_kv_heads, model.head_dim,
                      plan.num_blocks + (0 if config.offload else 1), plan.block_size, dtype, device,
                      config.offload)
    generator = torch.Generator(device=device)
    generator.manual_seed(config.seed)
    parts = dict(decoder=decoder, runtime=runtime, backends=backends, policy=policy.bind(layout),
                 generator=generator, block_size=plan.block_size)
    if config.offload:
        sizes = plan.offload
        offload = OffloadEngine.allocate(
            model, plan.num_blocks, plan.block_size, sizes.num_slots, sizes.slot_blocks,
            sizes.staging_blocks, config.max_num_seqs, dtype, runtime,
            device_layers=policy.offload_device_layers(model.num_layers))
        return ModelRunner(**parts, offload=offload, tails=TailSlots(config.max_num_seqs))
    cache = PagedKVCache.allocate(model, plan.num_blocks, plan.block_size, dtype, device)
    graphs = None
    if runtime.is_cuda and not config.enforce_eager:
        graphs = DecodeGraphs(decoder, cache, backends, parts["policy"],
                              min(config.cuda_graph_max_batch, config.max_num_seqs),
                              max_blocks_per_seq=-(-plan.max_model_len // plan.block_size),
                              max_context=plan.max_model_len)
        with torch.inference_mode():
            graphs.capture()
    return ModelRunner(**parts, cache=cache, graphs=graphs)
