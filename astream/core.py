"""EngineCore: the model, cache, scheduler and runner assembled, with no event loop.

The async Engine drives these pieces as stages; `step()` drives them
synchronously (tests, benchmarks and the plain step loop).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import torch

from astream.config import EngineConfig
from astream.executor.cuda_graphs import DecodeGraphs
from astream.executor.runner import ModelRunner, PreparedStep, StepOutput
from astream.executor.offload_plan import TailSlots
from astream.kvcache.block_manager import BlockManager
from astream.kvcache.offload_engine import OffloadEngine
from astream.kvcache.paged_cache import PagedKVCache
from astream.kvcache.sizing import CachePlan, check_max_model_len, plan_cache
from astream.models.config import ModelConfig
from astream.models.loader import LoadedModel, ProgressFn, load_model, open_checkpoint, resolve_model_path
from astream.ops.attention import select_backend
from astream.policies import make_policy
from astream.runtime.device import DeviceRuntime
from astream.sampling import SamplingParams
from astream.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from astream.sequence import Sequence
from astream.text import IncrementalDetokenizer, RequestText
from astream.tokenization import Prompt, prompt_to_ids, stop_token_ids

log = logging.getLogger("astream")

_MAX_FAULTS = 4          # a sequence in this many failed steps fails even in company


@dataclass(slots=True)
class TokenEvent:
    """One sampled token after detokenization and stop checks."""

    seq: Sequence
    token_id: int                       # -1 for the final event of an aborted or failed request
    text: str
    finish_reason: str | None
    error: str | None = None


@dataclass(slots=True)
class EngineCore:
    config: EngineConfig
    plan: CachePlan
    model: LoadedModel
    runtime: DeviceRuntime
    scheduler: Scheduler
    runner: ModelRunner
    eos_ids: frozenset[int]
    texts: dict[str, RequestText] = field(default_factory=dict)
    sequences: dict[str, Sequence] = field(default_factory=dict)
    _arrivals: itertools.count = field(default_factory=itertools.count)

    @classmethod
    def create(cls, config: EngineConfig, progress: ProgressFn | None = None) -> "EngineCore":
        device, dtype = config.torch_device(), config.torch_dtype()
        path = resolve_model_path(config.model)
        checkpoint = open_checkpoint(path, config.load_format)
        model_config = ModelConfig.from_hf(checkpoint.hf_config)
        check_max_model_len(config, model_config)          # fail before the slow part
        model = load_model(checkpoint, dtype, device, progress, config.tokenizer)
        plan = plan_cache(config, model_config, dtype, device)    # sized after the weights
        scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, plan.max_num_batched_tokens, plan.max_model_len,
                            align_chunks_to=plan.block_size if config.offload else 1),
            BlockManager(plan.num_blocks, plan.block_size, config.enable_prefix_caching))
        runtime = DeviceRuntime(device)
        generator = torch.Generator(device=device)
        generator.manual_seed(config.seed)
        runner = ModelRunner(model.decoder, None, runtime, generator, plan.block_size)
        if config.offload:
            runner.offload = _offload_engine(config, plan, model_config, dtype, runtime)
            runner.tails = TailSlots(config.max_num_seqs)
        else:
            runner.cache = PagedKVCache.allocate(model_config, plan.num_blocks, plan.block_size,
                                                 dtype, device)
            if device.type == "cuda" and not config.enforce_eager:
                runner.graphs = _capture_graphs(config, plan, model, runner.cache)
        eos = stop_token_ids(model.tokenizer, model.decoder.config.eos_token_ids)
        log.info("astream: %s on %s (%s), %d KV blocks of %d tokens%s, max_model_len %d, attention %s",
                 path.name, device, dtype, plan.num_blocks, plan.block_size,
                 " in host memory" if config.offload else "", plan.max_model_len, select_backend(device))
        return cls(config, plan, model, runtime, scheduler, runner, frozenset(eos))

    @property
    def tokenizer(self):
        return self.model.tokenizer

    # ---- requests -------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        return prompt_to_ids(self.tokenizer, prompt, self.model.decoder.config.vocab_size)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        if request_id in self.sequences:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, list(prompt_ids), params, next(self._arrivals))
        self.scheduler.add(seq)
        self.sequences[request_id] = seq
        detok = IncrementalDetokenizer.start(self.tokenizer, seq.prompt_token_ids)
        self.texts[request_id] = RequestText(params, detok, self.eos_ids)
        return seq

    def finish(self, request_id: str, reason: str, error: str | None = None) -> TokenEvent | None:
        """End a request from outside (abort, error); returns its last event, if it was live."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, reason)
        text = self.texts.pop(request_id)
        return TokenEvent(seq, -1, text.finish_early(reason), reason, error)

    def fail_step(self, step: PreparedStep, exc: BaseException) -> list[TokenEvent]:
        """A step raised. Alone, its sequence failed; in company, each one retries alone."""
        for seq in step.sampled:
            seq.num_pending -= 1
        seqs = [item.seq for item in step.batch.items if not item.seq.is_finished]
        message = f"{type(exc).__name__}: {exc}"
        events = []
        for seq in seqs:
            seq.faults += 1
            if len(seqs) == 1 or seq.faults >= _MAX_FAULTS:
                log.warning("request %s failed in a step: %s", seq.request_id, message)
                events.append(self.finish(seq.request_id, "error", message))
            else:
                self.scheduler.preempt(seq)
                seq.isolate = True
        return [e for e in events if e is not None]

    # ---- steps ----------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        return self.scheduler.schedule()

    def prepare(self, batch: ScheduledBatch) -> PreparedStep | None:
        """Build the step's inputs; from here its sampled tokens count as pending."""
        step = self.runner.prepare(batch)
        if step is not None:
            for row, seq in enumerate(step.sampled):
                seq.num_pending += 1
                seq.pending_row = row
        return step

    def launch(self, step: PreparedStep, previous: StepOutput | None = None) -> StepOutput:
        return self.runner.launch(step, previous)

    def process(self, output: StepOutput) -> list[TokenEvent]:
        """Consume a finished step's sampled ids (its `ready` event must have completed)."""
        blocks = self.scheduler.blocks
        for item in output.batch.items:
            if not item.seq.is_finished:       # this step's KV is written: cacheable now
                blocks.register_full_blocks(item.seq, item.start + item.num_tokens)
        events = []
        for seq, token_id in zip(output.sampled, output.host_ids.tolist()):
            seq.num_pending -= 1
            if seq.is_finished:
                continue                       # ended while this step was in flight
            try:
                events.append(self._append_token(seq, token_id))
            except Exception as exc:           # a detokenizer or stop-check fault: this request only
                log.warning("request %s failed in output processing: %r", seq.request_id, exc)
                event = self.finish(seq.request_id, "error", f"{type(exc).__name__}: {exc}")
                if event is not None:
                    events.append(event)
        return events

    def _append_token(self, seq: Sequence, token_id: int) -> TokenEvent:
        seq.output_token_ids.append(token_id)
        text = self.texts[seq.request_id]
        delta = text.append(token_id, seq.num_tokens >= self.plan.max_model_len)
        if text.finished:
            self.sequences.pop(seq.request_id, None)
            self.texts.pop(seq.request_id, None)
            self.scheduler.finish(seq, text.finished)
        return TokenEvent(seq, token_id, delta, text.finished)

    def step(self) -> list[TokenEvent]:
        """Schedule, run and process one step synchronously."""
        batch = self.schedule()
        step = self.prepare(batch) if batch is not None else None
        if step is None:
            return []
        output = self.launch(step)
        output.ready.synchronize()
        return self.process(output)

    def close(self) -> None:
        """Wait for the device, then give back what the engine pinned in host memory."""
        self.runtime.synchronize()
        if self.runner.offload is not None:
            self.runner.offload.free_host_pool()
        self.runtime.close()

    def stats(self) -> dict:
        blocks = self.scheduler.blocks
        return {"kv_blocks_total": blocks.num_blocks, "kv_blocks_free": blocks.num_free,
                "kv_block_size": blocks.block_size, "prefix_cache_hits": blocks.prefix_hits,
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "steps": self.scheduler.steps, "preemptions": self.scheduler.preemptions,
                "max_model_len": self.plan.max_model_len,
                "max_num_batched_tokens": self.scheduler.config.max_num_batched_tokens,
                "offload": self.config.offload,
                **self._offload_stats()}

    def _offload_stats(self) -> dict:
        engine = self.runner.offload
        if engine is None:
            return {}
        return {"offload_tail_blocks_used": self.runner.tails.in_use(),
                "offload_ring_slots": len(engine.slots), "offload_slot_blocks": engine.slot_blocks,
                "offload_bytes_loaded": engine.bytes_loaded,
                "offload_bytes_offloaded": engine.bytes_offloaded}


def _offload_engine(config: EngineConfig, plan: CachePlan, model: ModelConfig, dtype: torch.dtype,
                    runtime: DeviceRuntime) -> OffloadEngine:
    sizes = plan.offload
    return OffloadEngine.allocate(model, plan.num_blocks, plan.block_size, sizes.num_slots,
                                  sizes.slot_blocks, sizes.staging_blocks, config.max_num_seqs,
                                  dtype, runtime, make_policy(config.sparse_policy))


def _capture_graphs(config: EngineConfig, plan: CachePlan, model: LoadedModel,
                    cache: PagedKVCache) -> DecodeGraphs:
    graphs = DecodeGraphs(model.decoder, cache, min(config.cuda_graph_max_batch, config.max_num_seqs),
                          max_blocks_per_seq=-(-plan.max_model_len // plan.block_size),
                          max_context=plan.max_model_len)
    with torch.inference_mode():
        graphs.capture()
    return graphs
