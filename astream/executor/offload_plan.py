"""The host-side plan of one offloaded step: what to load, where new KV goes, what leaves.

Built once per step on the event-loop thread (it reads sequence state) and used by
every layer, since every layer moves the same blocks. It is built in two parts: host
lists (HostOffloadPlan), which tensor-parallel ranks get with the step's inputs since
only rank 0 holds the sequences, and the device tensors each rank makes of them. KV of a sequence lives in
host blocks, except its newest, not yet full block, which stays in a device tail.
Prefill chunks start on a block boundary (the scheduler aligns them), so a chunk's
earlier context is always whole host blocks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from astream.core.scheduler import ScheduledBatch
from astream.executor.inputs import to_device, varlen_meta
from astream.kvcache.offload_engine import NewKV, Run
from astream.ops.varlen import VarlenMeta


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
    # Device tensors, set on the copy `_finalize` returns (the host plan's stay None).
    prefill_index: torch.Tensor | None = None
    prefill_meta: VarlenMeta | None = None
    prefill_blocks: int = 0
    decode_index: torch.Tensor | None = None
    decode_table_tensor: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    decode_max: int = 0


@dataclass(slots=True, frozen=True)
class DecodeContext:
    """The host KV the step's decode rows may read: each row's full blocks before its tail,
    for a sparse policy to choose pages from (as `policies.DecodeQuery` wants them)."""

    rows: torch.Tensor                             # [D] rows of the step's tokens
    block_tables: torch.Tensor                     # [D, max_blocks] int32 host block ids
    context_lens: torch.Tensor                     # [D] int32 tokens in those blocks
    max_context: int
    host_blocks: int = 0                           # all rows' full host blocks together
    every_row: bool = False                        # rows is 0..D-1: the step decodes alone
    owners: torch.Tensor | None = None             # [D] int64 each row's sequence's kv_epoch


@dataclass(slots=True, frozen=True)
class PrefillContext:
    """Every prefill chunk's whole context (its prefix, from host blocks, then itself) packed
    one sequence after another, for a policy that replaces attention over all of it at once
    (a sparse prefill estimate needs every key of the prefix, not a ring slot of it)."""

    prefix_runs: tuple[Run, ...]                   # host blocks -> their first packed key row
    chunk_rows: torch.Tensor                       # [N] packed key row of each prefill token
    meta: VarlenMeta                               # queries: the chunks; keys: prefix + chunk
    num_keys: int


@dataclass(slots=True, frozen=True)
class OffloadStepPlan:
    jobs: list[JobTemplate]                        # every row's host context, for dense layers
    prefill_jobs: list[JobTemplate]                # prefill rows' only: sparse decode gathers
    decode_jobs: list[JobTemplate]                 # decode rows' only: prefill reads it whole
    num_prefill_tokens: int
    chunk_meta: VarlenMeta | None                  # causal attention within the new chunks
    new_kv: NewKV                                  # where the step's new KV goes
    decode_tail_tables: torch.Tensor | None        # [D, 1] each decode row's tail slot
    decode_tail_lens: torch.Tensor | None          # [D] tokens in that tail, the new one included
    decode_context: DecodeContext | None           # None without decode rows that have host KV
    prefill_context: PrefillContext | None = None  # asked for by a policy that replaces prefill
    whole_prefill: frozenset[int] = frozenset()    # layers whose prefill rows use prefill_context

    def reads_whole_prefill(self, layer: int) -> bool:
        return self.prefill_context is not None and layer in self.whole_prefill

    def layer_jobs(self, layer: int, sparse_decode: bool) -> list[JobTemplate]:
        """The ring jobs of a layer: decode rows that select pages gather them instead, and
        prefill rows read their whole context at once where the policy replaces prefill."""
        if self.reads_whole_prefill(layer):
            return [] if sparse_decode else self.decode_jobs
        return self.prefill_jobs if sparse_decode else self.jobs


@dataclass(slots=True)
class _PlanBuilder:
    """Host lists of one step's plan, filled row by row."""

    block_size: int
    slot_blocks: int
    sparse_decode: bool              # build prefill_jobs: decode rows may gather their pages
    whole_prefill: bool              # build decode_jobs and the prefill context
    jobs: list[JobTemplate] = field(default_factory=list)
    prefill_jobs: list[JobTemplate] = field(default_factory=list)
    decode_jobs: list[JobTemplate] = field(default_factory=list)
    prefix_runs: list[Run] = field(default_factory=list)
    chunk_rows: list[int] = field(default_factory=list)
    context_cu: list[int] = field(default_factory=lambda: [0])
    staging_rows: list[int] = field(default_factory=list)
    staging_index: list[int] = field(default_factory=list)
    tail_rows: list[int] = field(default_factory=list)
    tail_index: list[int] = field(default_factory=list)
    staging_runs: list[Run] = field(default_factory=list)
    tail_offloads: list[Run] = field(default_factory=list)
    tail_tables: list[list[int]] = field(default_factory=list)
    tail_lens: list[int] = field(default_factory=list)
    decode_rows: list[int] = field(default_factory=list)
    decode_tables: list[list[int]] = field(default_factory=list)
    decode_owners: list[int] = field(default_factory=list)
    chunk_cu: list[int] = field(default_factory=lambda: [0])
    staging_used: int = 0

    def prefill(self, seq, start: int, n: int, row: int, tail: int) -> None:
        bs, context_blocks = self.block_size, start // self.block_size
        assert start % bs == 0, "prefill chunks must start on a block boundary"
        for jobs in (self.jobs, self.prefill_jobs) if self.sparse_decode else (self.jobs,):
            _pack(jobs, self.slot_blocks, seq.block_table[:context_blocks], row, n, True)
        if self.whole_prefill:
            keys = self.context_cu[-1]
            self.prefix_runs += [Run(run.src, keys + run.dst * bs, run.count) for run in
                                 _runs(zip(seq.block_table[:context_blocks], range(context_blocks)))]
            self.chunk_rows += range(keys + start, keys + start + n)
            self.context_cu.append(keys + start + n)
        full, used = n // bs, self.staging_used
        self.staging_rows += range(row, row + full * bs)
        self.staging_index += range(used * bs, (used + full) * bs)
        self.staging_runs += _runs(zip(range(used, used + full),
                                       seq.block_table[context_blocks:context_blocks + full]))
        self.staging_used += full
        self.tail_rows += range(row + full * bs, row + n)
        self.tail_index += range(tail * bs, tail * bs + n - full * bs)
        self.chunk_cu.append(self.chunk_cu[-1] + n)

    def decode(self, seq, start: int, row: int, tail: int) -> None:
        bs, context_blocks = self.block_size, start // self.block_size
        for jobs in (self.jobs, self.decode_jobs) if self.whole_prefill else (self.jobs,):
            _pack(jobs, self.slot_blocks, seq.block_table[:context_blocks], row, 1, False)
        offset = start % bs
        self.tail_rows.append(row)
        self.tail_index.append(tail * bs + offset)
        self.tail_tables.append([tail])
        self.tail_lens.append(offset + 1)
        if offset == bs - 1:
            self.tail_offloads.append(Run(tail, seq.block_table[context_blocks], 1))
        self.decode_rows.append(row)
        self.decode_tables.append(seq.block_table[:context_blocks])
        self.decode_owners.append(seq.kv_epoch)


def build_offload_plan(batch: ScheduledBatch, block_size: int, slot_blocks: int,
                       device: torch.device, sparse_decode: bool = False,
                       whole_prefill: frozenset[int] = frozenset()) -> OffloadStepPlan:
    """The step's plan on `device` (`plan_offload`, then sent)."""
    return plan_offload(batch, block_size, slot_blocks, sparse_decode,
                        whole_prefill).send(device)


def plan_offload(batch: ScheduledBatch, block_size: int, slot_blocks: int,
                 sparse_decode: bool = False, whole_prefill: frozenset[int] = frozenset()
                 ) -> "HostOffloadPlan":
    """The step's plan as host lists. The jobs that sparse decode layers (`sparse_decode`:
    some layer may select pages) and whole-prefill layers (`whole_prefill`, the policy's
    `prefill_layers`) read are built only when the policy may ask for them."""
    plan = _PlanBuilder(block_size, slot_blocks, sparse_decode, bool(whole_prefill))
    row = 0
    for item in batch.items:
        tail = item.seq.slot                     # its device tail block: its running slot
        if item.num_tokens > 1:
            plan.prefill(item.seq, item.start, item.num_tokens, row, tail)
        else:
            plan.decode(item.seq, item.start, row, tail)
        row += item.num_tokens
    return HostOffloadPlan(plan, whole_prefill)


@dataclass(slots=True)
class HostOffloadPlan:
    """One step's offload plan before it goes to a device: plain lists that pickle small.
    Tensor-parallel ranks get it from rank 0 with the step's inputs, and each sends it to
    its own device: every rank moves the same blocks, each of its own KV heads."""

    lists: _PlanBuilder
    whole_prefill: frozenset[int]

    def send(self, device: torch.device) -> OffloadStepPlan:
        plan, block_size = self.lists, self.lists.block_size
        new_kv = NewKV(staging_rows=_tensor(plan.staging_rows, torch.int64, device),
                       staging_index=_tensor(plan.staging_index, torch.int64, device),
                       tail_rows=_tensor(plan.tail_rows, torch.int64, device),
                       tail_index=_tensor(plan.tail_index, torch.int64, device),
                       staging_to_host=tuple(plan.staging_runs),
                       tails_to_host=tuple(plan.tail_offloads))
        return OffloadStepPlan(
            jobs=[_finalize(job, block_size, device) for job in plan.jobs],
            prefill_jobs=[_finalize(job, block_size, device) for job in plan.prefill_jobs],
            decode_jobs=[_finalize(job, block_size, device) for job in plan.decode_jobs],
            num_prefill_tokens=plan.chunk_cu[-1],
            chunk_meta=varlen_meta(plan.chunk_cu, plan.chunk_cu, device) if len(plan.chunk_cu) > 1
            else None,
            new_kv=new_kv, decode_tail_tables=_tensor(plan.tail_tables, torch.int32, device),
            decode_tail_lens=_tensor(plan.tail_lens, torch.int32, device),
            decode_context=_decode_context(plan, device),
            prefill_context=_prefill_context(plan, device)
            if plan.whole_prefill and len(plan.chunk_cu) > 1 else None,
            whole_prefill=self.whole_prefill)


def _prefill_context(plan: _PlanBuilder, device: torch.device) -> PrefillContext:
    return PrefillContext(tuple(plan.prefix_runs), _tensor(plan.chunk_rows, torch.int64, device),
                          varlen_meta(plan.chunk_cu, plan.context_cu, device), plan.context_cu[-1])


def _decode_context(plan: _PlanBuilder, device: torch.device) -> DecodeContext | None:
    if not any(plan.decode_tables):
        return None
    width = max(len(t) for t in plan.decode_tables)
    tables = [t + [0] * (width - len(t)) for t in plan.decode_tables]
    lens = [len(t) * plan.block_size for t in plan.decode_tables]
    return DecodeContext(_tensor(plan.decode_rows, torch.int64, device),
                         _tensor(tables, torch.int32, device), _tensor(lens, torch.int32, device),
                         max(lens), sum(len(t) for t in plan.decode_tables),
                         owners=_tensor(plan.decode_owners, torch.int64, device))


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


def _finalize(job: JobTemplate, bs: int, device: torch.device) -> JobTemplate:
    """A copy of `job` with its device tensors; the host lists are shared, not copied."""
    job = dataclasses.replace(job)
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
    return job


def _tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    return to_device(values, dtype, device) if values else None
