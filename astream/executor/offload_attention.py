"""Attention with the KV cache in host memory, as the decoder's `attend` argument.

Per layer: write the new KV (full blocks to staging, the rest to device tails),
start their offload, attend over what is on the device (the new chunk itself,
the tails), then over each ring slot of host KV as it lands, merging by LSE.
Loads run `num_slots` jobs ahead of compute, across layer boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from astream.executor.offload_plan import JobTemplate, OffloadStepPlan
from astream.kvcache.offload_engine import OffloadEngine
from astream.ops.attention import merge_attention, paged_decode_attention, varlen_attention


@dataclass(slots=True)
class JobQueue:
    """Every layer's load jobs in compute order; loads stay `num_slots` jobs ahead."""

    engine: OffloadEngine
    jobs: list[JobTemplate]
    num_layers: int
    issued: int = 0
    done: int = 0

    @property
    def total(self) -> int:
        return len(self.jobs) * self.num_layers

    def prefetch(self) -> None:
        while self.issued < min(self.done + len(self.engine.slots), self.total):
            layer, job = divmod(self.issued, len(self.jobs))
            self.engine.load(self.issued % len(self.engine.slots), layer, self.jobs[job].runs)
            self.issued += 1

    def take(self) -> tuple[int, JobTemplate]:
        slot = self.done % len(self.engine.slots)
        self.engine.acquire(slot)
        return slot, self.jobs[self.done % len(self.jobs)]

    def finish(self, slot: int) -> None:
        self.engine.release(slot)
        self.done += 1
        self.prefetch()


@dataclass(slots=True)
class OffloadAttention:
    engine: OffloadEngine
    plan: OffloadStepPlan
    queue: JobQueue
    scale: float

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self._write_new_kv(layer, k, v)
        out, lse = self._on_device(layer, q, k, v)
        for _ in self.plan.jobs:
            slot_index, job = self.queue.take()
            out, lse = self._over_slot(self.engine.slots[slot_index], job, q, out, lse)
            self.queue.finish(slot_index)
        return out

    def _write_new_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        engine, plan = self.engine, self.plan
        engine.guard_tails(layer)
        if plan.staging_rows is not None:
            engine.store(engine.staging_for(layer), k.index_select(0, plan.staging_rows),
                         v.index_select(0, plan.staging_rows), plan.staging_index)
        if plan.tail_rows is not None:
            engine.store((engine.tail_k[layer], engine.tail_v[layer]), k.index_select(0, plan.tail_rows),
                         v.index_select(0, plan.tail_rows), plan.tail_index)
        engine.offload(layer, plan.staging_runs, plan.tail_offloads)

    def _on_device(self, layer: int, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        """The new chunks attend causally to themselves; single tokens to their tail block."""
        plan, split = self.plan, self.plan.num_prefill_tokens
        parts = []
        if split:
            parts.append(varlen_attention(q[:split], k[:split], v[:split], plan.chunk_meta,
                                          causal=True, scale=self.scale))
        if split < q.shape[0]:
            parts.append(paged_decode_attention(
                q[split:], self.engine.tail_k[layer], self.engine.tail_v[layer],
                plan.decode_tail_tables, plan.decode_tail_lens, scale=self.scale,
                max_context_len=self.engine.tail_k[layer].shape[1]))
        if len(parts) == 1:
            return parts[0][0], parts[0][1].contiguous()
        return torch.cat((parts[0][0], parts[1][0])), torch.cat((parts[0][1], parts[1][1]))

    def _over_slot(self, slot, job: JobTemplate, q, out, lse) -> tuple[torch.Tensor, torch.Tensor]:
        if job.prefill_index is not None:
            keys = job.prefill_blocks
            part = varlen_attention(
                q.index_select(0, job.prefill_index), slot.k[:keys].flatten(0, 1),
                slot.v[:keys].flatten(0, 1), job.prefill_meta, causal=False, scale=self.scale)
            out, lse = _merge_rows(out, lse, job.prefill_index, part)
        if job.decode_index is not None:
            part = paged_decode_attention(
                q.index_select(0, job.decode_index), slot.k, slot.v, job.decode_table_tensor,
                job.decode_lens, scale=self.scale, max_context_len=job.decode_max)
            out, lse = _merge_rows(out, lse, job.decode_index, part)
        return out, lse


def _merge_rows(out, lse, rows, part) -> tuple[torch.Tensor, torch.Tensor]:
    merged_out, merged_lse = merge_attention(out.index_select(0, rows), lse.index_select(0, rows),
                                             part[0], part[1])
    return out.index_copy(0, rows, merged_out), lse.index_copy(0, rows, merged_lse)
