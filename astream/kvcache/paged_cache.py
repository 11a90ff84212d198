"""The device-resident paged KV cache: one K and one V tensor per layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from astream.kvcache.kv_format import KVFormat, KVScales, as_bytes
from astream.models.config import ModelConfig
from astream.ops.kv_write import write_kv


@dataclass(slots=True)
class PagedKVCache:
    """k[layer] and v[layer] are [num_blocks + 1, block_size, kv_heads, head_dim].

    The extra last block is scratch: padded rows of a CUDA-graph batch write there,
    so padding never touches a block the block manager hands out. The tensors hold
    `format.dtype` (maybe fp8): `store` quantizes, `gather` and the kernels given
    `scales(layer)` read the values back.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    block_size: int
    num_blocks: int
    format: KVFormat

    @classmethod
    def allocate(cls, config: ModelConfig, num_blocks: int, block_size: int,
                 fmt: KVFormat, device: torch.device) -> "PagedKVCache":
        return cls.allocate_layers(config, tuple(range(config.num_layers)), num_blocks,
                                   block_size, fmt, device)

    @classmethod
    def allocate_layers(cls, config: ModelConfig, layers: tuple[int, ...], num_blocks: int,
                        block_size: int, fmt: KVFormat, device: torch.device) -> "PagedKVCache":
        """A cache that holds only `layers` (any other layer's entries are empty tensors): the
        device copy an offloaded engine keeps of the layers that read everything."""
        shape = (len(layers), 2, num_blocks + 1, block_size, config.num_kv_heads, config.head_dim)
        storage = torch.zeros(shape, dtype=fmt.dtype, device=device)
        empty = torch.empty(0, dtype=fmt.dtype, device=device)
        k, v = [empty] * config.num_layers, [empty] * config.num_layers
        for i, layer in enumerate(layers):
            k[layer], v[layer] = storage[i, 0], storage[i, 1]
        return cls(k=k, v=v, block_size=block_size, num_blocks=num_blocks, format=fmt)

    @property
    def scratch_slot(self) -> int:
        return self.num_blocks * self.block_size

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Write k/v [T, kv_heads, head_dim] at flat slot indices [T] (block * block_size +
        offset), quantized to the format."""
        write_kv(self.k[layer], self.v[layer], slots, k, v, self.format.scales(layer))

    def stored_keys(self, layer: int, k: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The keys `store` wrote at `slots` from `k`, as stored (the format's dtype): `k`
        itself when the format stores it as it is."""
        if not self.format.scaled and self.format.dtype == k.dtype:
            return k
        stored = self.k[layer].view(-1, *self.k[layer].shape[2:])
        return as_bytes(stored).index_select(0, slots).view(stored.dtype)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V at flat slots [N] as [N, kv_heads, head_dim] in the compute dtype."""
        k, v = self.k[layer], self.v[layer]
        return self.format.dequantize(layer, k.view(-1, *k.shape[2:]).index_select(0, slots),
                                      v.view(-1, *v.shape[2:]).index_select(0, slots))

    def scales(self, layer: int) -> KVScales | None:
        return self.format.scales(layer)
