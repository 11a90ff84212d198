"""One forward pass and sample per scheduled batch, on any device.

The runner only enqueues device work. It returns the sampled ids on the device,
a pinned host copy in flight, and an event that marks when that copy is done;
whoever needs the ids on the host waits for the event (the async engine awaits it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from astream.executor.cuda_graphs import DecodeGraphs
from astream.executor.inputs import StepInputs, build_inputs
from astream.executor.paged_attention import PagedAttention
from astream.executor.sampler import SamplingBatch, build_sampling_batch, sample
from astream.kvcache.paged_cache import PagedKVCache
from astream.models.decoder import Decoder
from astream.runtime.device import DeviceRuntime
from astream.scheduler import ScheduledBatch
from astream.sequence import Sequence


@dataclass(slots=True)
class PreparedStep:
    """A batch with its inputs already on the device; built on the event-loop thread."""

    batch: ScheduledBatch
    inputs: StepInputs
    sampling: SamplingBatch
    sampled: list[Sequence]             # sequences that get a token, in row order


@dataclass(slots=True)
class StepOutput:
    batch: ScheduledBatch
    sampled: list[Sequence]
    token_ids: torch.Tensor             # [S] int64 on the device
    host_ids: torch.Tensor              # [S] int64 on the host, valid once `ready` completes
    ready: object                       # a runtime event


@dataclass(slots=True)
class ModelRunner:
    decoder: Decoder
    cache: PagedKVCache
    runtime: DeviceRuntime
    generator: torch.Generator
    graphs: DecodeGraphs | None = None

    @property
    def scale(self) -> float:
        return self.decoder.config.head_dim ** -0.5

    def prepare(self, batch: ScheduledBatch) -> PreparedStep | None:
        """Snapshot the batch into device tensors. Sequences that ended since scheduling drop out."""
        batch.items = [item for item in batch.items if not item.seq.is_finished]
        if not batch.items:
            return None
        device = self.runtime.device
        inputs = build_inputs(batch, self.cache.block_size, device)
        sampling = build_sampling_batch(batch.items, self.decoder.config.vocab_size, device)
        return PreparedStep(batch, inputs, sampling, [item.seq for item in batch.items if item.sample])

    @torch.inference_mode()
    def launch(self, step: PreparedStep, previous: StepOutput | None) -> StepOutput:
        """Enqueue the forward pass, the sampler and the readback of the sampled ids."""
        inputs = step.inputs
        if inputs.pending_dst is not None:
            if previous is None:
                raise RuntimeError("a batch with pending tokens needs the previous step's output")
            inputs.input_ids.index_copy_(0, inputs.pending_dst, previous.token_ids[inputs.pending_src])
        hidden = self._forward(inputs)
        logits = self.decoder.logits(hidden.index_select(0, inputs.sample_rows))
        token_ids = sample(logits, step.sampling, self.generator)
        host_ids, ready = self.runtime.to_host(token_ids)
        return StepOutput(step.batch, step.sampled, token_ids, host_ids, ready)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(inputs):
            return self.graphs.run(inputs)
        attend = PagedAttention(self.cache, inputs.attn, self.scale)
        return self.decoder.forward(inputs.input_ids, inputs.positions, attend)
