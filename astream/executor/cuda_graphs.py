"""CUDA graphs for decode steps: per captured batch size, one graph per sampling mode
(executor.graph_sampling), padded to fit; the graph ends with the sampled ids, or the
greedy one with the logits a sampling tail graph then samples (executor.sampling_tail).

Padded rows write their K/V into the cache's scratch slot and attend to zero keys,
so padding never touches real blocks. Replays read the static input buffers, so a
step only copies its inputs into them and replays. An instance that was not captured
runs the same static program eagerly (CPU, tests).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from astream.executor.graph_sampling import GraphSampler, Mode, capture_sampling_graphs, replay
from astream.executor.inputs import AttentionMetadata, StepInputs
from astream.executor.offload_plan import OffloadStepPlan
from astream.executor.paged_attention import PagedAttention
from astream.executor.sampler import SamplingBatch
from astream.kvcache.paged_cache import PagedKVCache
from astream.models.decoder import Decoder
from astream.ops.backends import AttentionBackends
from astream.policies import PolicyRuntime, StepShape


def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes to capture: every decode batch up to max_batch pads to one of them."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)        # e.g. 3, or 20: without it a full batch has no graph
    return sizes


def replay_size(max_batch: int, n: int) -> int:
    """The batch size a decode step of n rows replays at: the smallest captured size that
    holds them (the rows past n are padding)."""
    return min(s for s in capture_sizes(max_batch) if s >= n)


@dataclass(slots=True)
class DecodeGraphs:
    decoder: Decoder
    cache: PagedKVCache
    backends: AttentionBackends
    policy: PolicyRuntime
    generator: torch.Generator
    max_batch: int
    max_blocks_per_seq: int
    max_context: int
    tails: bool = True                   # sampling tails and their tables (build.captures_tails)
    graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    sampler: GraphSampler | None = None
    steps: int = 0                       # steps run from the static buffers

    def __post_init__(self) -> None:
        device = self.decoder.device
        b, m = self.max_batch, self.max_blocks_per_seq
        self.buffers = {
            "input_ids": torch.zeros(b, dtype=torch.int64, device=device),
            "positions": torch.zeros(b, dtype=torch.int64, device=device),
            "slots": torch.full((b,), self.cache.scratch_slot, dtype=torch.int64, device=device),
            "tables": torch.zeros(b, m, dtype=torch.int32, device=device),
            "lens": torch.zeros(b, dtype=torch.int32, device=device),
            "hidden": torch.zeros(b, self.decoder.config.hidden_size, dtype=self.decoder.dtype,
                                  device=device),
        }
        self.sampler = GraphSampler.allocate(self.decoder, self.generator, b, self.tails)

    def capture(self) -> None:
        self.graphs = capture_sampling_graphs(capture_sizes(self.max_batch), self._run_eager,
                                              self.sampler, self.buffers["hidden"], self.decoder.device)

    def can_run(self, inputs: StepInputs, plan: OffloadStepPlan | None = None) -> bool:
        attn = inputs.attn
        return (attn.num_prefill_tokens == 0 and inputs.num_tokens <= self.max_batch
                and inputs.sample_rows.shape[0] == inputs.num_tokens
                and attn.decode_block_tables.shape[1] <= self.max_blocks_per_seq)

    def run(self, inputs: StepInputs, plan: OffloadStepPlan | None, mode: Mode | None,
            sampling: SamplingBatch | None, previous_ids: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden states [n, H], the sampled ids [n], or None where the host samples), sampled
        in `mode` (graph_sampling.replay)."""
        n = inputs.num_tokens
        size = replay_size(self.max_batch, n)
        buf, attn = self.buffers, inputs.attn
        buf["input_ids"][:n].copy_(inputs.input_ids)
        buf["positions"][:n].copy_(inputs.positions)
        buf["slots"][:n].copy_(attn.slot_mapping)
        buf["slots"][n:size].fill_(self.cache.scratch_slot)
        width = attn.decode_block_tables.shape[1]
        buf["tables"][:n, :width].copy_(attn.decode_block_tables)
        buf["lens"][:n].copy_(attn.decode_context_lens)
        buf["lens"][n:size].zero_()
        ids = replay(self.graphs, size, n, mode, sampling, self.sampler, self._run_eager, buf["hidden"],
                     previous_ids)
        self.steps += 1
        return buf["hidden"][:n], ids

    def _run_eager(self, size: int) -> torch.Tensor:
        buf = self.buffers
        meta = AttentionMetadata(
            num_prefill_tokens=0, slot_mapping=buf["slots"][:size], prefill=None,
            prefill_key_slots=None, decode_block_tables=buf["tables"][:size],
            decode_context_lens=buf["lens"][:size], decode_max_context=self.max_context)
        step = self.policy.plan_step(StepShape(size, self.max_context))
        attend = PagedAttention(self.cache, meta, self.backends, self.policy, step,
                                self.decoder.config.head_dim ** -0.5)
        return self.decoder.forward(buf["input_ids"][:size], buf["positions"][:size], attend)
