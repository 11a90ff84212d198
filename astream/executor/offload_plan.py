"""The host-side plan of one offloaded step: what to load, where new KV goes, what leaves.

Built once per step on the event-loop thread (it reads sequence state) and used by
every layer, since every layer moves the same blocks. KV of a sequence lives in
host blocks, except its newest, not yet full block, which stays in a device tail.
Prefill chunks start on a block boundary (the scheduler aligns them), so a chunk's
earlier context is always whole host blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from astream.executor.inputs import to_device, varlen_meta
from astream.kvcache.offload_engine import NewKV, Run
from astream.ops.varlen import VarlenMeta
from astream.scheduler import ScheduledBatch
from astream.sequence import SequenceStatus


@dataclass(slots=True)
class JobTemplate:
    """Host blocks one ring slot receives, and how queries attend to them (every layer alike)."""

    runs: list[Run] = field(default_factory=list)        # host block -> slot block
    used_blocks: int = 0
    prefill_rows: list[int] = field(default_factory=list)
    prefill_cu_q: list[int] = field(default_factory=lambda: [0])
    prefill_cu_k: list[int] = field(default_factory=lambda: [0])
    decode_rows: list[int] = field(default_factory=list)
    decode_tables: list[list[int]] = field(default_factory=list)
    # Device tensors, filled by `finalize`.
    prefill_index: torch.Tensor | None = None
    prefill_meta: VarlenMeta | None = None
    prefill_blocks: int = 0
    decode_index: torch.Tensor | None = None
    decode_table_tensor: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    decode_max: int = 0


@dataclass(slots=True, frozen=True)
class OffloadStepPlan:
    jobs: list[JobTemplate]
    num_prefill_tokens: int
    chunk_meta: VarlenMeta | None                  # causal attention within the new chunks
    new_kv: NewKV                                  # where the step's new KV goes
    decode_tail_tables: torch.Tensor | None        # [D, 1] each decode row's tail slot
    decode_tail_lens: torch.Tensor | None          # [D] tokens in that tail, the new one included


@dataclass(slots=True)
class TailSlots:
    """Which device tail block each running sequence owns."""

    capacity: int
    owners: dict = field(default_factory=dict)     # Sequence -> slot

    def slot_for(self, seq) -> int:
        if seq not in self.owners:
            self._reclaim()
            used = set(self.owners.values())
            self.owners[seq] = next(i for i in range(self.capacity) if i not in used)
        return self.owners[seq]

    def in_use(self) -> int:
        self._reclaim()
        return len(self.owners)

    def _reclaim(self) -> None:
        for seq in [s for s in self.owners if s.status is not SequenceStatus.RUNNING]:
            del self.owners[seq]


def build_offload_plan(batch: ScheduledBatch, block_size: int, slot_blocks: int, tails: TailSlots,
                       device: torch.device) -> OffloadStepPlan:
    bs = block_size
    prefill = [item for item in batch.items if item.num_tokens > 1]
    jobs: list[JobTemplate] = []
    staging_rows, staging_index, tail_rows, tail_index = [], [], [], []
    staging_runs, tail_offloads, tail_tables, tail_lens = [], [], [], []
    chunk_cu, row, staging_used = [0], 0, 0
    for item in batch.items:
        seq, start, n = item.seq, item.start, item.num_tokens
        tail = tails.slot_for(seq)
        context_blocks = start // bs
        if n > 1:
            assert start % bs == 0, "prefill chunks must start on a block boundary"
            _pack(jobs, slot_blocks, seq.block_table[:context_blocks], row, n, True)
            full = n // bs
            staging_rows += range(row, row + full * bs)
            staging_index += range(staging_used * bs, (staging_used + full) * bs)
            staging_runs += _runs(zip(range(staging_used, staging_used + full),
                                      seq.block_table[context_blocks:context_blocks + full]))
            staging_used += full
            tail_rows += range(row + full * bs, row + n)
            tail_index += range(tail * bs, tail * bs + n - full * bs)
            chunk_cu.append(chunk_cu[-1] + n)
        else:
            _pack(jobs, slot_blocks, seq.block_table[:context_blocks], row, 1, False)
            offset = start % bs
            tail_rows.append(row)
            tail_index.append(tail * bs + offset)
            tail_tables.append([tail])
            tail_lens.append(offset + 1)
            if offset == bs - 1:
                tail_offloads.append(Run(tail, seq.block_table[context_blocks], 1))
        row += n
    for job in jobs:
        _finalize(job, bs, device)
    num_prefill = chunk_cu[-1]
    new_kv = NewKV(staging_rows=_tensor(staging_rows, torch.int64, device),
                   staging_index=_tensor(staging_index, torch.int64, device),
                   tail_rows=_tensor(tail_rows, torch.int64, device),
                   tail_index=_tensor(tail_index, torch.int64, device),
                   staging_to_host=tuple(staging_runs), tails_to_host=tuple(tail_offloads))
    return OffloadStepPlan(
        jobs=jobs, num_prefill_tokens=num_prefill,
        chunk_meta=varlen_meta(chunk_cu, chunk_cu, device) if prefill else None, new_kv=new_kv,
        decode_tail_tables=_tensor(tail_tables, torch.int32, device),
        decode_tail_lens=_tensor(tail_lens, torch.int32, device))


def _pack(jobs: list[JobTemplate], slot_blocks: int, blocks: list[int], row: int, n: int,
          is_prefill: bool) -> None:
    """Place one sequence's context blocks into slots, splitting across slots if needed."""
    while blocks:
        if not jobs or jobs[-1].used_blocks == slot_blocks or (is_prefill and jobs[-1].decode_rows):
            jobs.append(JobTemplate())
        job = jobs[-1]
        take = blocks[:slot_blocks - job.used_blocks]
        blocks = blocks[len(take):]
        job.runs += _runs(zip(take, range(job.used_blocks, job.used_blocks + len(take))))
        slot_range = list(range(job.used_blocks, job.used_blocks + len(take)))
        job.used_blocks += len(take)
        if is_prefill:
            job.prefill_rows += range(row, row + n)
            job.prefill_cu_q.append(job.prefill_cu_q[-1] + n)
            job.prefill_cu_k.append(job.prefill_cu_k[-1] + len(take))
            job.prefill_blocks = job.used_blocks
        else:
            job.decode_rows.append(row)
            job.decode_tables.append(slot_range)


def _runs(pairs) -> list[Run]:
    """Coalesce (source block, destination block) pairs that both count up into copy runs."""
    runs: list[Run] = []
    for src, dst in pairs:
        if runs and src == runs[-1].src + runs[-1].count and dst == runs[-1].dst + runs[-1].count:
            runs[-1] = runs[-1]._replace(count=runs[-1].count + 1)
        else:
            runs.append(Run(src, dst, 1))
    return runs


def _finalize(job: JobTemplate, bs: int, device: torch.device) -> None:
    if job.prefill_rows:
        cu_k = [c * bs for c in job.prefill_cu_k]
        job.prefill_index = _tensor(job.prefill_rows, torch.int64, device)
        job.prefill_meta = varlen_meta(job.prefill_cu_q, cu_k, device)
    if job.decode_rows:
        width = max(len(t) for t in job.decode_tables)
        job.decode_index = _tensor(job.decode_rows, torch.int64, device)
        job.decode_table_tensor = _tensor([t + [0] * (width - len(t)) for t in job.decode_tables],
                                          torch.int32, device)
        lens = [len(t) * bs for t in job.decode_tables]
        job.decode_lens = _tensor(lens, torch.int32, device)
        job.decode_max = max(lens)


def _tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    return to_device(values, dtype, device) if values else None
