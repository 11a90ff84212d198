"""CUDA graphs for decode steps: one graph per captured batch size, padded to fit.

Padded rows write their K/V into the cache's scratch slot and attend to zero keys,
so padding never touches real blocks. Replays read the static input buffers, so a
step only copies its inputs into them and replays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from astream.executor.inputs import AttentionMetadata, StepInputs
from astream.executor.offload_plan import OffloadStepPlan
from astream.executor.paged_attention import PagedAttention
from astream.kvcache.paged_cache import PagedKVCache
from astream.models.decoder import Decoder
from astream.ops.backends import AttentionBackends
from astream.policies import PolicyRuntime


def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes to capture: every decode batch up to max_batch pads to one of them."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)        # e.g. 3, or 20: without it a full batch has no graph
    return sizes


def capture_graphs(max_batch: int, run_eager: Callable[[int], torch.Tensor], out: torch.Tensor,
                   device: torch.device) -> dict[int, torch.cuda.CUDAGraph]:
    """One graph per capture size, largest first, sharing one memory pool: each replay runs
    `run_eager(size)` over the static buffers and leaves its result in out[:size]."""
    graphs, pool = {}, torch.cuda.graph_pool_handle()
    for size in sorted(capture_sizes(max_batch), reverse=True):
        run_eager(size)                                 # warm up kernels (Triton compiles here)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out[:size] = run_eager(size)
        graphs[size] = graph
    torch.cuda.synchronize(device)
    return graphs


def padded_size(sizes, n: int) -> int:
    """The smallest captured size that holds n rows."""
    return min(s for s in sizes if s >= n)


@dataclass(slots=True)
class DecodeGraphs:
    decoder: Decoder
    cache: PagedKVCache
    backends: AttentionBackends
    policy: PolicyRuntime
    max_batch: int
    max_blocks_per_seq: int
    max_context: int
    graphs: dict[int, torch.cuda.CUDAGraph] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    steps: int = 0                       # steps replayed

    def capture(self) -> None:
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
        self.graphs = capture_graphs(self.max_batch, self._run_eager, self.buffers["hidden"], device)

    def can_run(self, inputs: StepInputs, plan: OffloadStepPlan | None = None) -> bool:
        attn = inputs.attn
        return (attn.num_prefill_tokens == 0 and inputs.num_tokens <= self.max_batch
                and attn.decode_block_tables.shape[1] <= self.max_blocks_per_seq)

    def run(self, inputs: StepInputs, plan: OffloadStepPlan | None = None) -> torch.Tensor:
        n = inputs.num_tokens
        size = padded_size(self.graphs, n)
        buf, attn = self.buffers, inputs.attn
        buf["input_ids"][:n].copy_(inputs.input_ids)
        buf["positions"][:n].copy_(inputs.positions)
        buf["slots"][:n].copy_(attn.slot_mapping)
        buf["slots"][n:size].fill_(self.cache.scratch_slot)
        width = attn.decode_block_tables.shape[1]
        buf["tables"][:n, :width].copy_(attn.decode_block_tables)
        buf["lens"][:n].copy_(attn.decode_context_lens)
        buf["lens"][n:size].zero_()
        self.graphs[size].replay()
        self.steps += 1
        return buf["hidden"][:n]

    def _run_eager(self, size: int) -> torch.Tensor:
        buf = self.buffers
        meta = AttentionMetadata(
            num_prefill_tokens=0, slot_mapping=buf["slots"][:size], prefill=None,
            prefill_key_slots=None, decode_block_tables=buf["tables"][:size],
            decode_context_lens=buf["lens"][:size], decode_max_context=self.max_context)
        attend = PagedAttention(self.cache, meta, self.backends, self.policy,
                                self.decoder.config.head_dim ** -0.5)
        return self.decoder.forward(buf["input_ids"][:size], buf["positions"][:size], attend)
