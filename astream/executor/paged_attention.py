"""Attention over the device-resident paged cache, as the decoder's `attend` argument.

The sparse policy sees every layer's new keys as they are stored (if its traits say it
watches them), may replace attention over a prefill chunk, and, on the layers the step's
plan selects (`PolicyRuntime.plan_step`), chooses per sequence and KV head the pages a
decode query reads; Full does none of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from astream.executor.inputs import AttentionMetadata
from astream.kvcache.paged_cache import PagedKVCache
from astream.ops.backends import AttentionBackends
from astream.ops.varlen import VarlenMeta
from astream.policies import DecodeQuery, PolicyRuntime, StepPlan


@dataclass(slots=True)
class PagedAttention:
    """Store the step's new K/V, then attend: varlen for prefill chunks, paged for single tokens."""

    cache: PagedKVCache
    meta: AttentionMetadata
    backends: AttentionBackends
    policy: PolicyRuntime
    step: StepPlan                                  # the policy's plan of this step
    scale: float
    full_block_lens: torch.Tensor | None = None     # decode tokens in full blocks (Quest picks there)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        self.cache.store(layer, k, v, meta.slot_mapping)
        if self.policy.traits.watches_keys:
            self.policy.on_kv_written(layer, self.cache.stored_keys(layer, k, meta.slot_mapping),
                                      meta.slot_mapping)
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
        out, _ = prefill_attention(self.policy, self.backends, layer, q, k, v, self.meta.prefill,
                                   causal=True, scale=self.scale)
        return out

    def _decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        meta, cache = self.meta, self.cache
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        if layer in self.step.select_layers:
            # Pages are chosen among full blocks; the newest block is read whole, as the
            # device tail is with offload, so both paths read the same pages.
            if self.full_block_lens is None:       # once a step, not once a layer
                bs = cache.block_size
                self.full_block_lens = ((lens.long() - 1).clamp(min=0) // bs * bs).to(torch.int32)
            full = self.full_block_lens
            chosen = self.policy.select_decode(
                layer, DecodeQuery(q, tables, full, meta.decode_max_context, append_newest=True))
            out, _ = self.backends.paged_decode_selected(
                q, cache.k[layer], cache.v[layer], tables, chosen.indices, chosen.counts, lens,
                page_size=chosen.page_size, scale=self.scale, kv_scales=cache.scales(layer))
            return out
        out, _ = self.backends.paged_decode(q, cache.k[layer], cache.v[layer], tables, lens,
                                            scale=self.scale, max_context_len=meta.decode_max_context,
                                            kv_scales=cache.scales(layer))
        return out


def prefill_attention(policy: PolicyRuntime, backends: AttentionBackends, layer: int, q, k, v,
                      meta: VarlenMeta, *, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over one prefill part: the policy's, on a layer it replaces (and where it
    takes the part), else the kernel's."""
    if layer in policy.traits.prefill_layers:
        replaced = policy.prefill_attention(layer, q, k, v, meta, causal, scale)
        if replaced is not None:
            return replaced
    return backends.varlen(q, k, v, meta, causal=causal, scale=scale)
