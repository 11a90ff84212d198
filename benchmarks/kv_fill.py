"""Synthetic KV: sequences whose context is already in an offloaded engine's cache, without
prefilling it (a million-token prefill takes far longer than the decode steps timed).

`fill_prefix` writes random K/V straight into the host pool (and the device copy of the
layers a policy keeps there), hands every layer's keys to the policy runtime as prefill
would (`on_kv_written`: Quest's page and group bounds), and publishes the blocks in the
prefix cache under the prompt's tokens. A request for that prompt then takes them as a
cached prefix: its first step computes only the prompt's last block (attending to the
whole context), and decode proceeds as after a real prefill.
"""

from __future__ import annotations

import torch

from astream.base.sampling import SamplingParams
from astream.core.engine_core import EngineCore
from astream.core.sequence import Sequence

CHUNK_TOKENS = 65536            # tokens of one layer written a pass


def fill_prefix(core: EngineCore, prompt: list[int], seed: int = 0) -> int:
    """Fill the KV of prompt's full blocks but the last (the ones a request for it reuses);
    return the tokens filled. Needs offload and the prefix cache."""
    if not core.config.offload or not core.config.enable_prefix_caching:
        raise ValueError("fill_prefix needs offload=True and enable_prefix_caching=True")
    blocks = core.scheduler.blocks
    block = blocks.block_size
    owner = Sequence("fill", prompt, SamplingParams(max_tokens=1), arrival=-1)
    tokens = (len(prompt) - 1) // block * block
    blocks.grow(owner, tokens)
    ids = list(owner.block_table)
    _write_kv(core, ids, seed)
    owner.num_computed_tokens = tokens
    blocks.register_full_blocks(owner, tokens)
    blocks.release(owner)                  # hashed: they stay in the prefix cache
    return tokens


def _write_kv(core: EngineCore, ids: list[int], seed: int) -> None:
    engine, runtime = core.runner.offload, core.runner.policy
    device = core.runtime.device
    dtype = engine.format.dtype
    block, (kv_heads, _, head_dim) = core.plan.block_size, engine.host_k[0].shape[1:]
    per_pass = max(1, CHUNK_TOKENS // block)
    gen = torch.Generator(device=device).manual_seed(seed)
    for layer in range(len(engine.host_k)):
        for start in range(0, len(ids), per_pass):
            chunk = ids[start:start + per_pass]
            n = len(chunk)
            # Token-major [n, block, KVH, D], as attention and the policy see the cache.
            k, v = (torch.randn(n, block, kv_heads, head_dim, generator=gen, device=device)
                    .to(dtype) for _ in range(2))
            index = torch.tensor(chunk, dtype=torch.int64, device=device)
            slots = (index.view(-1, 1) * block + torch.arange(block, device=device)).view(-1)
            runtime.on_kv_written(layer, k.view(-1, kv_heads, head_dim), slots)
            if layer in engine.device_layers:       # read and written on the device only
                engine.on_device.k[layer][index] = k
                engine.on_device.v[layer][index] = v
                continue
            for host, new in ((engine.host_k[layer], k), (engine.host_v[layer], v)):
                _copy_blocks(host, chunk, new.transpose(1, 2))
            device_k = engine.device_keys(layer)
            if device_k is not None:                # keys_on_device: the device's copy too
                device_k[index] = k.transpose(1, 2)
    core.runtime.synchronize()


def _copy_blocks(host: torch.Tensor, ids: list[int], new: torch.Tensor) -> None:
    """host[ids] = new (head-major blocks), one copy per run of consecutive ids."""
    start = 0
    while start < len(ids):
        end = start + 1
        while end < len(ids) and ids[end] == ids[end - 1] + 1:
            end += 1
        host[ids[start]:ids[start] + end - start].copy_(new[start:end])
        start = end
