"""How many KV blocks fit, and what max_model_len and token budget follow from it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from astream.config import EngineConfig
from astream.models.config import ModelConfig


@dataclass(slots=True, frozen=True)
class CachePlan:
    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int


def plan_cache(cfg: EngineConfig, model: ModelConfig, dtype: torch.dtype,
               device: torch.device) -> CachePlan:
    check_max_model_len(cfg, model)
    block = cfg.kv_block_size
    max_len = cfg.max_model_len or model.max_position_embeddings
    budget = cfg.max_num_batched_tokens or _default_budget(cfg, device)
    bytes_per_block = model.kv_bytes_per_token * block * torch.empty((), dtype=dtype).element_size()
    blocks = cfg.num_kv_blocks or _fit_blocks(cfg, model, dtype, device, budget, bytes_per_block)
    capacity = blocks * block
    if capacity < max_len:
        if cfg.max_model_len:
            raise ValueError(f"max_model_len {cfg.max_model_len} does not fit in the KV cache: "
                             f"{blocks} blocks x {block} tokens = {capacity} tokens; lower "
                             "max_model_len or raise num_kv_blocks / the memory budget")
        max_len = capacity            # derived, so shrink it to what fits
    if max_len < 2:
        raise ValueError(f"the KV cache holds only {capacity} tokens; give it more blocks")
    return CachePlan(blocks, block, max_len, max(budget, cfg.max_num_seqs))


def check_max_model_len(cfg: EngineConfig, model: ModelConfig) -> None:
    if cfg.max_model_len and cfg.max_model_len > model.max_position_embeddings:
        raise ValueError(f"max_model_len {cfg.max_model_len} exceeds the model's context of "
                         f"{model.max_position_embeddings} tokens")


def _default_budget(cfg: EngineConfig, device: torch.device) -> int:
    return 8192 if device.type == "cuda" else 2048


def _fit_blocks(cfg: EngineConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device,
                budget_tokens: int, bytes_per_block: int) -> int:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        reserve = _activation_bytes(model, budget_tokens, cfg.max_num_seqs, dtype)
        available = int(total * cfg.gpu_memory_utilization) - used - reserve
    else:
        available = int(cfg.cpu_kv_cache_gib * 2**30)
    blocks = available // bytes_per_block
    if blocks < 1:
        raise ValueError(f"no memory left for the KV cache ({available / 2**20:.0f} MiB after weights "
                         "and activations); raise gpu_memory_utilization or lower "
                         "max_num_batched_tokens")
    return int(blocks)


def _activation_bytes(model: ModelConfig, tokens: int, seqs: int, dtype: torch.dtype) -> int:
    """A generous bound on one step's transient memory: MLP, QKV, logits and graph pools."""
    width = 2 * model.intermediate_size + 4 * model.hidden_size + \
        (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    element = torch.empty((), dtype=dtype).element_size()
    logits = seqs * model.vocab_size * 4 * 4
    return 2 * tokens * width * element + logits + 512 * 2**20
