"""The device-resident paged KV cache: one K and one V tensor per layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from astream.models.config import ModelConfig


@dataclass(slots=True)
class PagedKVCache:
    """k[layer] and v[layer] are [num_blocks + 1, block_size, kv_heads, head_dim].

    The extra last block is scratch: padded rows of a CUDA-graph batch write there,
    so padding never touches a block the block manager hands out.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    block_size: int
    num_blocks: int

    @classmethod
    def allocate(cls, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> "PagedKVCache":
        shape = (config.num_layers, 2, num_blocks + 1, block_size, config.num_kv_heads, config.head_dim)
        storage = torch.zeros(shape, dtype=dtype, device=device)
        return cls(k=list(storage[:, 0].unbind(0)), v=list(storage[:, 1].unbind(0)),
                   block_size=block_size, num_blocks=num_blocks)

    @property
    def scratch_slot(self) -> int:
        return self.num_blocks * self.block_size

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Write k/v [T, kv_heads, head_dim] at flat slot indices [T] (block * block_size + offset)."""
        self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, slots, k)
        self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, slots, v)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.k[layer], self.v[layer]
        return (k.view(-1, *k.shape[2:]).index_select(0, slots),
                v.view(-1, *v.shape[2:]).index_select(0, slots))
