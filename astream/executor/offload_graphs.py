"""CUDA graphs for offloaded decode steps. Launched eagerly, such a step is bound by the
host (about a thousand small launches, 1-2 ms a layer); from graphs, by the device. A
graph may not hold the eager ring's copies (their host addresses would be frozen), so:

- under a policy that selects decode pages (Quest), one graph a step: the dense layers
  read their device copy, every other layer gathers the pages its queries choose with a
  kernel reading the pinned pool in place;
- under one that never does ("dense", e.g. Full), a chain of graphs a step
  (executor.graph_chain), cut before each offloaded layer reads its ring slot: between
  the graphs the host issues the copy-engine loads of each layer's whole host context, a
  layer ahead (kvcache.copy_ring). Only steps whose rows' host blocks fit one slot.

New KV goes to the device tails in both.

A graph holds no host decision and no wait on work outside it, so around each replay:
- before: the compute stream waits for every layer's latest offload (the graph reads host
  pages and overwrites tails those copies may still touch: `OffloadEngine.wait_offloads`);
- after: the tails the step filled leave for the host (`OffloadEngine.send_tails`).

Every sparse layer selects, whatever the context: a budget that covers the context picks
every page, which is what the ring would have loaded. Padded rows write the scratch slot
of the device layers and of the policy's bounds, and the engine's scratch tail, and read
no host page. An instance that was not captured runs the same static program eagerly
(CPU, tests).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from astream.executor.cuda_graphs import capture_sizes, replay_size
from astream.executor.graph_chain import ChainCapture, capture_chained_steps
from astream.executor.graph_sampling import GraphSampler, Mode, capture_sampling_graphs, replay
from astream.executor.inputs import AttentionMetadata, StepInputs
from astream.executor.offload_attention import OffloadAttention
from astream.executor.offload_plan import DecodeContext, JobTemplate, OffloadStepPlan
from astream.executor.paged_attention import PagedAttention
from astream.executor.sampler import SamplingBatch
from astream.kvcache.copy_ring import CopyRing, packed_block_table
from astream.kvcache.offload_engine import NewKV, OffloadEngine, Run
from astream.models.decoder import Decoder
from astream.ops.backends import AttentionBackends
from astream.policies import PolicyRuntime, StepPlan, StepShape


def selects_everywhere(policy: PolicyRuntime, engine: OffloadEngine, num_layers: int,
                       max_context: int) -> bool:
    """Whether every layer off the device selects decode pages: only then can a decode step
    skip the ring, and so be captured."""
    chosen = policy.plan_step(StepShape(1, max_context)).select_layers
    return bool(chosen) and all(layer in engine.device_layers or layer in chosen
                                for layer in range(num_layers))


def decodes_densely(policy: PolicyRuntime, num_layers: int, max_context: int) -> bool:
    """Whether no layer ever selects decode pages (selection only starts as contexts grow,
    so none at the longest context means none at all)."""
    chosen = policy.plan_step(StepShape(1, max_context)).select_layers
    return not any(layer in chosen for layer in range(num_layers))


@dataclass(slots=True)
class OffloadDecodeGraphs:
    decoder: Decoder
    engine: OffloadEngine
    backends: AttentionBackends
    policy: PolicyRuntime
    generator: torch.Generator
    max_batch: int
    max_blocks_per_seq: int
    max_context: int
    dense: bool = False                  # load whole contexts (the policy never selects)
    tails: bool = True                   # sampling tails and their tables (build.captures_tails)
    graphs: dict[tuple[str, int], object] = field(default_factory=dict)   # each has replay()
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    sampler: GraphSampler | None = None
    copy_runs: list[Run] = field(default_factory=list)   # dense: this step's loads
    ring: CopyRing | None = None         # dense: this step's ring, driven between graphs
    steps: int = 0                       # steps run from the static buffers

    def __post_init__(self) -> None:
        device, b, m = self.decoder.device, self.max_batch, self.max_blocks_per_seq

        def zeros(*shape: int, dtype=torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.buffers = {
            "input_ids": zeros(b), "positions": zeros(b),
            "slots": zeros(b),                              # host-pool slot of each new token
            "tables": zeros(b, m, dtype=torch.int32),       # every block: the device layers
            "lens": zeros(b, dtype=torch.int32),
            "tail_index": zeros(b), "tail_tables": zeros(b, 1, dtype=torch.int32),
            "tail_lens": zeros(b, dtype=torch.int32),
            "host_tables": zeros(b, m, dtype=torch.int32),  # full host blocks: pages to pick from
            "host_lens": zeros(b, dtype=torch.int32),
            "owners": zeros(b),                             # each row's sequence's kv_epoch
            "rows": torch.arange(b, device=device),
            "hidden": torch.zeros(b, self.decoder.config.hidden_size, dtype=self.decoder.dtype,
                                  device=device),
        }
        self.sampler = GraphSampler.allocate(self.decoder, self.generator, b, self.tails)

    @property
    def scratch_slot(self) -> int:
        engine = self.engine
        return engine.host_k[0].shape[0] * engine.block_size

    @property
    def sparse_layers(self) -> list[int]:
        return [layer for layer in range(self.decoder.config.num_layers)
                if layer not in self.engine.device_layers]

    def capture(self) -> None:
        self.engine.settle()
        self._pad(0, self.max_batch)
        self.copy_runs = []
        sizes, hidden, device = capture_sizes(self.max_batch), self.buffers["hidden"], self.decoder.device
        if self.dense:
            self.graphs = capture_chained_steps(sizes, self._run_eager, self.sampler, hidden, device,
                                                between=lambda _: self.ring.advance(),
                                                after=lambda: self.ring.finish())
        else:
            self.graphs = capture_sampling_graphs(sizes, self._run_eager, self.sampler, hidden, device)

    def can_run(self, inputs: StepInputs, plan: OffloadStepPlan | None) -> bool:
        attn = inputs.attn
        return (plan is not None and attn.num_prefill_tokens == 0
                and inputs.num_tokens <= self.max_batch
                and inputs.sample_rows.shape[0] == inputs.num_tokens
                and attn.decode_block_tables.shape[1] <= self.max_blocks_per_seq
                and (not self.dense or self._fits_a_slot(plan.decode_context)))

    def _fits_a_slot(self, context: DecodeContext | None) -> bool:
        """Dense: the rows' host blocks fit one ring slot (one copy job a layer)."""
        blocks = context.host_blocks if context is not None else 0
        return blocks <= self.engine.slot_blocks

    def run(self, inputs: StepInputs, plan: OffloadStepPlan, mode: Mode | None,
            sampling: SamplingBatch | None, previous_ids: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden states [n, H], the sampled ids [n], or None where the host samples), sampled
        in `mode` (graph_sampling.replay)."""
        n = inputs.num_tokens
        size = replay_size(self.max_batch, n)
        self._fill(inputs, plan)
        self._pad(n, size)
        self.engine.wait_offloads()
        if self.dense:                     # one job at most: the rows' host blocks fit a slot
            assert len(plan.jobs) <= 1, "a dense step from graphs loads one slot a layer"
            self.copy_runs = plan.jobs[0].runs if plan.jobs else []
            self.ring = CopyRing(self.engine, self.sparse_layers, self.copy_runs)
        ids = replay(self.graphs, size, n, mode, sampling, self.sampler, self._run_eager,
                     self.buffers["hidden"], previous_ids)
        self.engine.send_tails(self.sparse_layers, plan.new_kv.tails_to_host)
        self.steps += 1
        return self.buffers["hidden"][:n], ids

    def _fill(self, inputs: StepInputs, plan: OffloadStepPlan) -> None:
        buf, attn, n = self.buffers, inputs.attn, inputs.num_tokens
        buf["input_ids"][:n].copy_(inputs.input_ids)
        buf["positions"][:n].copy_(inputs.positions)
        buf["slots"][:n].copy_(attn.slot_mapping)
        buf["tables"][:n, :attn.decode_block_tables.shape[1]].copy_(attn.decode_block_tables)
        buf["lens"][:n].copy_(attn.decode_context_lens)
        buf["tail_index"][:n].copy_(plan.new_kv.tail_index)
        buf["tail_tables"][:n].copy_(plan.decode_tail_tables)
        buf["tail_lens"][:n].copy_(plan.decode_tail_lens)
        context = plan.decode_context
        if context is None:                 # no row has a full block on the host yet
            buf["host_lens"][:n].zero_()
            buf["owners"][:n].fill_(-1)
        else:
            buf["host_tables"][:n, :context.block_tables.shape[1]].copy_(context.block_tables)
            buf["host_lens"][:n].copy_(context.context_lens)
            buf["owners"][:n].copy_(context.owners)

    def _pad(self, n: int, size: int) -> None:
        """Rows n..size: one token in the scratch tail, no host page, nothing else touched."""
        buf, scratch_tail = self.buffers, self.engine.scratch_tail
        buf["slots"][n:size].fill_(self.scratch_slot)
        buf["lens"][n:size].zero_()
        buf["tail_index"][n:size].fill_(scratch_tail * self.engine.block_size)
        buf["tail_tables"][n:size].fill_(scratch_tail)
        buf["tail_lens"][n:size].fill_(1)
        buf["host_lens"][n:size].zero_()
        buf["owners"][n:size].fill_(-1)                  # no sequence's: their slots start empty

    def _run_eager(self, size: int, capture: ChainCapture | None = None) -> torch.Tensor:
        """The static program over rows :size (what a graph, or a chain of them, captures)."""
        buf, engine, layers = self.buffers, self.engine, self.decoder.config.num_layers
        rows = buf["rows"][:size]
        host = DecodeContext(rows, buf["host_tables"][:size], buf["host_lens"][:size], self.max_context,
                             every_row=True, owners=buf["owners"][:size])
        plan = OffloadStepPlan(
            jobs=[], prefill_jobs=[], decode_jobs=[], num_prefill_tokens=0, chunk_meta=None,
            new_kv=NewKV(None, None, rows, buf["tail_index"][:size], (), ()),
            decode_tail_tables=buf["tail_tables"][:size], decode_tail_lens=buf["tail_lens"][:size],
            decode_context=None if self.dense else host)
        meta = AttentionMetadata(
            num_prefill_tokens=0, slot_mapping=buf["slots"][:size], prefill=None,
            prefill_key_slots=None, decode_block_tables=buf["tables"][:size],
            decode_context_lens=buf["lens"][:size], decode_max_context=self.max_context)
        scale = self.decoder.config.head_dim ** -0.5
        # Dense: no layer selects. Else every layer off the device selects, whatever the
        # context: the plan at the longest one.
        step = StepPlan() if self.dense else self.policy.plan_step(StepShape(size, self.max_context))
        on_device = None if engine.on_device is None else PagedAttention(
            engine.on_device, meta, self.backends, self.policy, step, scale)
        if self.dense:
            # This step's copies (`copy_runs`), issued at the cuts; during a capture, none.
            loads = self.ring = CopyRing(engine, self.sparse_layers, self.copy_runs,
                                         capture.cut if capture is not None else None)
            # One ring job: each row reads its own packed blocks of the slot.
            nblocks = (host.context_lens // engine.block_size).to(torch.int32)
            packed = packed_block_table(nblocks, host.block_tables.shape[1])
            plan.jobs.append(JobTemplate(decode_index=rows, decode_table_tensor=packed,
                                         decode_lens=host.context_lens, decode_max=self.max_context))
        else:
            loads = engine.loads([[] for _ in range(layers)])
        attend = OffloadAttention(engine, plan, loads, step, meta.slot_mapping, self.backends,
                                  self.policy, scale, on_device, predict=self.decoder.early_query)
        hidden = self.decoder.forward(buf["input_ids"][:size], buf["positions"][:size], attend,
                                      attend.lookahead)
        if self.dense:
            loads.finish()
        return hidden
