"""One forward pass and sample per scheduled batch, on any device.

The runner only enqueues device work. A step is a generator (`program`) that
yields a device event wherever the host may pause (after each layer when KV is
offloaded) and returns the StepOutput: sampled ids on the device, a pinned host
copy in flight, and the event that marks when that copy is done. The async
engine drives the generator and awaits those events; `launch` runs it straight
through for synchronous callers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generator, Protocol

import torch

from astream.core.scheduler import ScheduledBatch
from astream.core.sequence import Sequence
from astream.executor.cuda_graphs import DecodeGraphs, replay_size
from astream.executor.decode_tables import DecodeTables
from astream.executor.graph_sampling import Mode, captured_mode, graph_mode
from astream.executor.inputs import HostInputs, StepInputs, pack_inputs
from astream.executor.logprobs import StepLogprobs, compute_logprobs
from astream.executor.offload_attention import OffloadAttention, plan_offloaded_step, whole_prefill_loads
from astream.executor.offload_graphs import OffloadDecodeGraphs
from astream.executor.offload_plan import HostOffloadPlan, OffloadStepPlan, plan_offload
from astream.executor.paged_attention import PagedAttention
from astream.executor.sampler import SamplingBatch, build_sampling_batch, sample
from astream.kvcache.kv_format import KVFormat
from astream.kvcache.offload_engine import OffloadEngine
from astream.kvcache.paged_cache import PagedKVCache
from astream.models.decoder import Decoder, LookaheadFn
from astream.ops.backends import AttentionBackends
from astream.policies import PolicyRuntime, StepShape
from astream.runtime.device import DeviceRuntime
from astream.runtime.events import Event

StepProgram = Generator[Event, None, "StepOutput"]


class StepFollowers(Protocol):
    """The other tensor-parallel ranks, seen from rank 0 (astream.parallel)."""

    def send(self, step: "HostStep") -> None:
        """Hand every other rank the step about to run."""

    def failed(self, error: BaseException) -> Exception:
        """A step that had started on every rank raised: stop them all; the error to raise."""

    def abandoned(self) -> None:
        """A step that had started on every rank was dropped part-way (its program closed):
        the other ranks may wait in a collective rank 0 never issues, so they cannot leave
        the group cleanly."""


@dataclass(slots=True)
class HostStep:
    """What another tensor-parallel rank needs of a step, as host data built on rank 0 (the
    only rank that holds the sequences): its inputs, with offload the offload plan, and
    whether rank 0 replays its decode graphs and in which sampling mode, so that every rank
    replays the same one."""

    inputs: HostInputs
    offload: HostOffloadPlan | None = None
    graphed: bool = False
    sampling_mode: Mode | None = None      # what rank 0's graphs sample in (None: its host samples)


@dataclass(slots=True)
class PreparedStep:
    """A batch with its inputs already on the device; built on the event-loop thread."""

    batch: ScheduledBatch
    inputs: StepInputs
    sampling: SamplingBatch
    sampled: list[Sequence]             # sequences that get a token, in row order
    offload_plan: OffloadStepPlan | None = None
    host: HostStep | None = None        # the step before it left the host, for other ranks
    graphed: bool = False               # replayed from the decode graphs


@dataclass(slots=True)
class StepOutput:
    batch: ScheduledBatch
    sampled: list[Sequence]
    token_ids: torch.Tensor             # [S] int64 on the device
    host_ids: torch.Tensor              # [S] int64 on the host, valid once `ready` completes
    ready: Event
    offloaded: list[Event] = field(default_factory=list)   # D2H events of this step's new KV
    logprobs: StepLogprobs | None = None                    # host copies, valid with host_ids


@dataclass(slots=True)
class ModelRunner:
    """Runs steps over one KV backend: `cache` (device-resident), or `offload` (host pool
    behind a device ring, with a device tail block per running slot); either may replay
    decode steps from CUDA `graphs`. Built by executor.build. It keeps nothing of a request
    between steps: each step's batch names its sequences, and what is kept (the decode
    tables) is numbers."""

    decoder: Decoder
    runtime: DeviceRuntime
    backends: AttentionBackends
    policy: PolicyRuntime
    generator: torch.Generator
    block_size: int
    cache: PagedKVCache | None = None
    graphs: DecodeGraphs | OffloadDecodeGraphs | None = None
    offload: OffloadEngine | None = None
    decode_tables: DecodeTables = field(default_factory=DecodeTables)   # last step's, by kv_epoch
    eos_ids: frozenset[int] = frozenset()   # held back, with stop_token_ids, until min_tokens
    followers: StepFollowers | None = None  # rank 0 of several tensor-parallel ranks

    @property
    def scale(self) -> float:
        return self.decoder.config.head_dim ** -0.5

    @property
    def kv_format(self) -> KVFormat:
        return self.cache.format if self.offload is None else self.offload.format

    def prepare(self, batch: ScheduledBatch) -> PreparedStep | None:
        """Snapshot the batch into device tensors. Sequences that ended since scheduling drop out."""
        live = tuple(item for item in batch.items if not item.seq.is_finished)
        if not live:
            return None
        if len(live) < len(batch.items):
            batch = ScheduledBatch(batch.step, live)
        device = self.runtime.device
        host = pack_inputs(batch, self.block_size, self.decode_tables)
        inputs = host.send(device)
        sampling = build_sampling_batch(batch.items, self.decoder.config.vocab_size, device,
                                        self.eos_ids)
        plan = host_plan = None
        if self.offload is not None:
            traits = self.policy.traits
            host_plan = plan_offload(
                batch, self.block_size, self.offload.slot_blocks,
                sparse_decode=bool(traits.decode_layers), whole_prefill=traits.prefill_layers)
            plan = host_plan.send(device)
        graphed = self.graphs is not None and self.graphs.can_run(inputs, plan)
        follow = None
        if self.followers is not None:
            # Resolved against rank 0's graphs: only they have the sampling tails.
            mode = None
            if graphed:
                size = replay_size(self.graphs.max_batch, inputs.num_tokens)
                mode = captured_mode(self.graphs.graphs, size, graph_mode(sampling))
            follow = HostStep(host, host_plan, graphed, mode)
        return PreparedStep(batch, inputs, sampling, [item.seq for item in batch.items if item.sample],
                            plan, follow, graphed)

    def launch(self, step: PreparedStep, previous: StepOutput | None) -> StepOutput:
        """Run a step's program straight through (synchronous callers)."""
        program = self.program(step, previous)
        try:
            while True:
                next(program)
        except StopIteration as stop:
            return stop.value

    def program(self, step: PreparedStep, previous: StepOutput | None) -> StepProgram:
        """Enqueue the forward pass, the sampler (inside a decode step's graphs unless a row
        has a seed) and the readback of the sampled ids and logprobs. With tensor-parallel
        followers, the step goes to them first; once it has, a failure leaves the ranks out
        of step, so it is fatal, and a step dropped part-way rules out a clean close."""
        if step.inputs.pending_dst is not None and previous is None:
            raise RuntimeError("a batch with pending tokens needs the previous step's output")
        if self.followers is None:
            return (yield from self._program(step, previous))
        self.followers.send(step.host)
        finished = False
        try:
            output = yield from self._program(step, previous)
            finished = True
            return output
        except Exception as exc:
            raise self.followers.failed(exc) from exc
        finally:
            if not finished:            # raised, or closed at a yield (the engine cancelled)
                self.followers.abandoned()

    @torch.inference_mode()
    def follow(self, step: HostStep, previous_ids: torch.Tensor | None) -> torch.Tensor:
        """A follower rank's part of a step rank 0 runs: the same forward pass over this
        rank's shard (and, with offload, its own KV heads' host pool and ring) and its share
        of the logits; rank 0 samples and broadcasts the ids, returned for the next step's
        pending rows.

        Where rank 0 replays a decode graph, so does this rank, the same one: its sampler
        included, since the graphs of every rank must hold the same collectives (the logits'
        gather) in the same order; a sampling tail, which holds none, only rank 0 captures
        and replays (this rank replays the greedy graph in its stead). The ids it samples are
        dropped for rank 0's, so the ranks' generators need not agree."""
        device = self.runtime.device
        inputs = step.inputs.send(device)
        if inputs.pending_dst is not None:
            inputs.input_ids.index_copy_(0, inputs.pending_dst, previous_ids[inputs.pending_src])
        plan = None if step.offload is None else step.offload.send(device)
        sampled = None
        if step.graphed:
            hidden, sampled = self.graphs.run(inputs, plan, step.sampling_mode, None)
        else:
            forward = self._forward(inputs) if plan is None else self._offloaded_forward(inputs, plan)
            try:
                while True:
                    next(forward)
            except StopIteration as stop:
                hidden = stop.value
        if sampled is None:                 # rank 0 samples on the host, from gathered logits
            self.decoder.logits(hidden.index_select(0, inputs.sample_rows))
        token_ids = torch.empty(step.inputs.num_sampled, dtype=torch.int64, device=device)
        return self.decoder.tp.broadcast(token_ids)

    @torch.inference_mode()
    def _program(self, step: PreparedStep, previous: StepOutput | None) -> StepProgram:
        inputs = step.inputs
        if inputs.pending_dst is not None:
            inputs.input_ids.index_copy_(0, inputs.pending_dst, previous.token_ids[inputs.pending_src])
        token_ids = found = None
        previous_ids = None if previous is None else previous.token_ids
        if step.graphed:
            hidden, token_ids = self.graphs.run(inputs, step.offload_plan, graph_mode(step.sampling),
                                                step.sampling, previous_ids)
            if token_ids is not None and step.sampling.num_logprobs is not None:
                found = self.graphs.sampler.logprobs(inputs.num_tokens)   # its tail computed them
        elif step.offload_plan is not None:
            hidden = yield from self._offloaded_forward(inputs, step.offload_plan)
        else:
            hidden = yield from self._forward(inputs)
        if token_ids is None:
            logits = self.decoder.logits(hidden.index_select(0, inputs.sample_rows))
            token_ids = sample(logits, step.sampling, self.generator, previous_ids)
            if step.sampling.num_logprobs is not None:
                found = compute_logprobs(logits, token_ids, step.sampling.num_logprobs)
        logprobs = None
        if found is not None:
            # Queued before the ids' copy: the event that marks the ids marks these too.
            logprobs = StepLogprobs(*(self.runtime.copy_to_host(t) for t in
                                      (found.chosen, found.top_values, found.top_ids)))
        if self.decoder.tp is not None:
            self.decoder.tp.broadcast(token_ids)
        host_ids, ready = self.runtime.to_host(token_ids)
        offloaded = self.offload.pending_offloads() if self.offload is not None else []
        return StepOutput(step.batch, step.sampled, token_ids, host_ids, ready, offloaded, logprobs)

    def _forward(self, inputs: StepInputs) -> Generator[Event, None, torch.Tensor]:
        attn = inputs.attn
        step = self.policy.plan_step(StepShape(inputs.num_tokens - attn.num_prefill_tokens,
                                               attn.decode_max_context))
        attend = PagedAttention(self.cache, attn, self.backends, self.policy, step, self.scale)
        return (yield from self._layers(inputs, attend))

    def _offloaded_forward(self, inputs: StepInputs, plan: OffloadStepPlan
                           ) -> Generator[Event, None, torch.Tensor]:
        engine, layers = self.offload, self.decoder.config.num_layers
        step = plan_offloaded_step(plan, self.policy)
        loads = engine.loads([[] if layer in engine.device_layers else
                              [job.runs for job in plan.layer_jobs(layer, layer in step.select_layers)]
                              for layer in range(layers)])
        on_device = None if engine.on_device is None else PagedAttention(
            engine.on_device, inputs.attn, self.backends, self.policy, step, self.scale)
        attend = OffloadAttention(engine, plan, loads, step, inputs.attn.slot_mapping,
                                  self.backends, self.policy, self.scale, on_device,
                                  whole_prefill_loads(engine, plan, layers),
                                  predict=self.decoder.early_query)
        return (yield from self._layers(inputs, attend, attend.lookahead))

    def _layers(self, inputs: StepInputs, attend, lookahead: LookaheadFn | None = None
                ) -> Generator[Event, None, torch.Tensor]:
        """Layer by layer; yields after each so the driver can bound how far the host runs
        ahead of the device, and let other work on the event loop in between."""
        decoder = self.decoder
        stream = decoder.embed(inputs.input_ids)
        for layer in range(decoder.config.num_layers):
            stream = decoder.layer(layer, stream, inputs.positions, attend, lookahead)
            yield self.runtime.record_event()
        return decoder.final_norm(stream)
