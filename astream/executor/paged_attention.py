"""Attention over the device-resident paged cache, as the decoder's `attend` argument."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from astream.executor.inputs import AttentionMetadata
from astream.kvcache.paged_cache import PagedKVCache
from astream.ops.backends import AttentionBackends


@dataclass(slots=True)
class PagedAttention:
    """Store the step's new K/V, then attend: varlen for prefill chunks, paged for single tokens."""

    cache: PagedKVCache
    meta: AttentionMetadata
    backends: AttentionBackends
    scale: float

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        self.cache.store(layer, k, v, meta.slot_mapping)
        split = meta.num_prefill_tokens
        if split == q.shape[0]:
            return self._prefill(layer, q, k, v)
        if split == 0:
            return self._decode(layer, q)
        out = torch.empty_like(q)
        out[:split] = self._prefill(layer, q[:split], k[:split], v[:split])
        out[split:] = self._decode(layer, q[split:])
        return out

    def _prefill(self, layer: int, q, k, v) -> torch.Tensor:
        if self.meta.prefill_key_slots is not None:
            k, v = self.cache.gather(layer, self.meta.prefill_key_slots)
        out, _ = self.backends.varlen(q, k, v, self.meta.prefill, causal=True, scale=self.scale)
        return out

    def _decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        out, _ = self.backends.paged_decode(
            q, self.cache.k[layer], self.cache.v[layer], meta.decode_block_tables,
            meta.decode_context_lens, scale=self.scale, max_context_len=meta.decode_max_context)
        return out
