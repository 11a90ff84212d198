"""CUDA graphs for offloaded decode steps. Launched eagerly, such a step is bound by the
host (about a thousand small launches, 1-2 ms a layer); from a graph, by the device. A
graph may not read through the eager ring (its copies' host addresses would be frozen),
so host KV reaches it through device kernels that read the pinned pool in place:

- under a policy that selects decode pages (Quest): the dense layers read their device
  copy, every other layer gathers the pages its queries choose;
- under one that never does ("dense", e.g. Full): each offloaded layer's whole context is
  gathered into a ring slot a layer ahead, on a side stream (kvcache.gathered_ring). That
  kernel reads at about 46 GB/s where the eager ring's copies reach 54, so a step takes it
  only while its layers are small enough for the eager step to be paced by the host
  (`dense_max_layer_bytes`), and only if every row's host blocks fit one slot.

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

from astream.executor.cuda_graphs import capture_sizes, padded_size
from astream.executor.graph_sampling import GraphSampler, capture_sampling_graphs, replay
from astream.executor.inputs import AttentionMetadata, StepInputs
from astream.executor.offload_attention import OffloadAttention
from astream.executor.offload_plan import DecodeContext, JobTemplate, OffloadStepPlan
from astream.executor.paged_attention import PagedAttention
from astream.executor.sampler import SamplingBatch
from astream.kvcache.gathered_ring import GATHER_SLOTS, GatheredRing
from astream.kvcache.offload_engine import NewKV, OffloadEngine
from astream.models.decoder import Decoder
from astream.ops.backends import AttentionBackends
from astream.policies import PolicyRuntime


def selects_everywhere(policy: PolicyRuntime, engine: OffloadEngine, num_layers: int,
                       max_context: int) -> bool:
    """Whether every layer off the device selects decode pages: only then can a decode step
    skip the ring, and so be captured."""
    return any(policy.selects_decode(layer, max_context) for layer in range(num_layers)) and all(
        layer in engine.device_layers or policy.selects_decode(layer, max_context)
        for layer in range(num_layers))


# An eager offloaded layer costs the H100's host about 1.8 ms, and within a step the gather
# reads about 46 GB/s against the copy engine's 54 (docs/BENCHMARKS.md, issue 15): past
# about 80 MiB a layer the eager step is paced by PCIe, not the host, and copies faster.
DENSE_GRAPH_MAX_LAYER_BYTES = 80 << 20


def decodes_densely(policy: PolicyRuntime, num_layers: int, max_context: int) -> bool:
    """Whether no layer ever selects decode pages (selection only starts as contexts grow,
    so none at the longest context means none at all)."""
    return not any(policy.selects_decode(layer, max_context) for layer in range(num_layers))


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
    dense: bool = False                  # gather whole contexts (the policy never selects)
    dense_max_layer_bytes: int = DENSE_GRAPH_MAX_LAYER_BYTES
    graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    sampler: GraphSampler | None = None
    side: torch.cuda.Stream | None = None  # dense: the gathers' stream
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
            "rows": torch.arange(b, device=device),
            "hidden": torch.zeros(b, self.decoder.config.hidden_size, dtype=self.decoder.dtype,
                                  device=device),
        }
        self.sampler = GraphSampler.allocate(self.decoder, self.generator, b)
        if self.dense:
            assert len(self.engine.slots) >= GATHER_SLOTS, "dense graphs gather into two ring slots"
            self.side = self.engine.runtime.new_stream()

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
        self.graphs = capture_sampling_graphs(capture_sizes(self.max_batch), self._run_eager,
                                              self.sampler, self.buffers["hidden"], self.decoder.device)

    def can_run(self, inputs: StepInputs, plan: OffloadStepPlan | None) -> bool:
        attn = inputs.attn
        return (plan is not None and attn.num_prefill_tokens == 0
                and inputs.num_tokens <= self.max_batch
                and inputs.sample_rows.shape[0] == inputs.num_tokens
                and attn.decode_block_tables.shape[1] <= self.max_blocks_per_seq
                and (not self.dense or self._gather_fits(plan.decode_context)))

    def _gather_fits(self, context: DecodeContext | None) -> bool:
        """Dense: the rows' host blocks fit one slot and a layer of them is small enough
        that the eager step would be paced by the host."""
        blocks = context.host_blocks if context is not None else 0
        engine = self.engine
        return blocks <= engine.slot_blocks and blocks * engine.block_bytes <= self.dense_max_layer_bytes

    def run(self, inputs: StepInputs, plan: OffloadStepPlan,
            sampling: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden states [n, H], the sampled ids [n], or None where the host samples)."""
        n = inputs.num_tokens
        size = padded_size(capture_sizes(self.max_batch), n)
        self._fill(inputs, plan)
        self._pad(n, size)
        self.engine.wait_offloads()
        ids = replay(self.graphs, size, n, sampling, self.sampler, self._run_eager, self.buffers["hidden"])
        if self.dense:
            self._after_gathers(plan.decode_context)
        self.engine.send_tails(self.sparse_layers, plan.new_kv.tails_to_host)
        self.steps += 1
        return self.buffers["hidden"][:n], ids

    def _after_gathers(self, context: DecodeContext | None) -> None:
        """The eager ring's next loads into the gather slots wait for this step's reads."""
        engine = self.engine
        for slot in engine.slots[:GATHER_SLOTS]:
            slot.free = engine.runtime.record_event()
        blocks = context.host_blocks if context is not None else 0
        engine.bytes_loaded += blocks * engine.block_bytes * len(self.sparse_layers)

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
        else:
            buf["host_tables"][:n, :context.block_tables.shape[1]].copy_(context.block_tables)
            buf["host_lens"][:n].copy_(context.context_lens)

    def _pad(self, n: int, size: int) -> None:
        """Rows n..size: one token in the scratch tail, no host page, nothing else touched."""
        buf, scratch_tail = self.buffers, self.engine.scratch_tail
        buf["slots"][n:size].fill_(self.scratch_slot)
        buf["lens"][n:size].zero_()
        buf["tail_index"][n:size].fill_(scratch_tail * self.engine.block_size)
        buf["tail_tables"][n:size].fill_(scratch_tail)
        buf["tail_lens"][n:size].fill_(1)
        buf["host_lens"][n:size].zero_()

    def _run_eager(self, size: int) -> torch.Tensor:
        buf, engine, layers = self.buffers, self.engine, self.decoder.config.num_layers
        rows = buf["rows"][:size]
        host = DecodeContext(rows, buf["host_tables"][:size], buf["host_lens"][:size], self.max_context)
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
        on_device = None if engine.on_device is None else PagedAttention(
            engine.on_device, meta, self.backends, self.policy, scale)
        if self.dense:
            loads = self._gathered_ring(host)
            # One ring job: each row reads its own packed blocks of the slot.
            plan.jobs.append(JobTemplate(decode_index=rows, decode_table_tensor=loads.dst_table,
                                         decode_lens=host.context_lens, decode_max=self.max_context))
            sparse = [False] * layers
        else:
            loads = engine.loads([[] for _ in range(layers)])
            sparse = [layer not in engine.device_layers for layer in range(layers)]
        attend = OffloadAttention(engine, plan, loads, sparse, meta.slot_mapping, self.backends,
                                  self.policy, scale, on_device)
        hidden = self.decoder.forward(buf["input_ids"][:size], buf["positions"][:size], attend)
        if self.dense:
            loads.finish()
        return hidden

    def _gathered_ring(self, host: DecodeContext) -> GatheredRing:
        """Every offloaded layer's whole host context, packed into a ring slot a layer ahead."""
        nblocks = (host.context_lens // self.engine.block_size).to(torch.int32)
        return GatheredRing.started(self.engine, host.block_tables, nblocks, self.sparse_layers,
                                    self.side)

