"""Attention with the KV cache in host memory, as the decoder's `attend` argument.

Per layer: hand the new KV to the OffloadEngine (staging or device tails, and on its way
to the host), attend over what is on the device (the new chunk itself, the tails), then
over each ring slot of host KV as it lands, merging by LSE. Loads run ahead of compute,
across layer boundaries (kvcache.offload_engine.RingLoads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from astream.executor.offload_plan import JobTemplate, OffloadStepPlan
from astream.kvcache.offload_engine import OffloadEngine, RingLoads, RingSlot
from astream.ops.attention import merge_attention
from astream.ops.backends import AttentionBackends
from astream.policies import BlockOffload, SparsePolicy


@dataclass(slots=True)
class OffloadAttention:
    engine: OffloadEngine
    plan: OffloadStepPlan
    loads: RingLoads
    backends: AttentionBackends
    policy: SparsePolicy
    scale: float

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.engine.write_layer(layer, k, v, self.plan.new_kv)
        self._blocks_leaving(layer, k)
        out, lse = self._on_device(layer, q, k, v)
        for job, slot in self.loads.layer(layer):
            out, lse = self._over_slot(slot, self.plan.jobs[job], q, out, lse)
        return out

    def _blocks_leaving(self, layer: int, k: torch.Tensor) -> None:
        """The policy sees each full block's keys while they are still on the device."""
        new, block_size = self.plan.new_kv, self.engine.slots[0].k.shape[1]
        if new.staging_to_host:
            staged = k.index_select(0, new.staging_rows).view(-1, block_size, *k.shape[1:])
            for src, host, count in new.staging_to_host:
                for i in range(count):
                    self.policy.on_block_offload(BlockOffload(host + i, layer, staged[src + i]))
        tail_k, _ = self.engine.tails(layer)
        for tail, host, _ in new.tails_to_host:
            self.policy.on_block_offload(BlockOffload(host, layer, tail_k[tail]))

    def _on_device(self, layer: int, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        """The new chunks attend causally to themselves; single tokens to their tail block."""
        plan, split = self.plan, self.plan.num_prefill_tokens
        parts = []
        if split:
            parts.append(self.backends.varlen(q[:split], k[:split], v[:split], plan.chunk_meta,
                                              causal=True, scale=self.scale))
        if split < q.shape[0]:
            tail_k, tail_v = self.engine.tails(layer)
            parts.append(self.backends.paged_decode(
                q[split:], tail_k, tail_v, plan.decode_tail_tables, plan.decode_tail_lens,
                scale=self.scale, max_context_len=tail_k.shape[1]))
        if len(parts) == 1:
            return parts[0][0], parts[0][1].contiguous()
        return torch.cat((parts[0][0], parts[1][0])), torch.cat((parts[0][1], parts[1][1]))

    def _over_slot(self, slot: RingSlot, job: JobTemplate, q, out, lse) -> tuple[torch.Tensor, torch.Tensor]:
        if job.prefill_index is not None:
            keys = job.prefill_blocks
            part = self.backends.varlen(
                q.index_select(0, job.prefill_index), slot.k[:keys].flatten(0, 1),
                slot.v[:keys].flatten(0, 1), job.prefill_meta, causal=False, scale=self.scale)
            out, lse = _merge_rows(out, lse, job.prefill_index, part)
        if job.decode_index is not None:
            part = self.backends.paged_decode(
                q.index_select(0, job.decode_index), slot.k, slot.v, job.decode_table_tensor,
                job.decode_lens, scale=self.scale, max_context_len=job.decode_max)
            out, lse = _merge_rows(out, lse, job.decode_index, part)
        return out, lse


def _merge_rows(out, lse, rows, part) -> tuple[torch.Tensor, torch.Tensor]:
    merged_out, merged_lse = merge_attention(out.index_select(0, rows), lse.index_select(0, rows),
                                             part[0], part[1])
    return out.index_copy(0, rows, merged_out), lse.index_copy(0, rows, merged_lse)
