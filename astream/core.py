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
from astream.executor.runner import ModelRunner, StepOutput
from astream.kvcache.block_manager import BlockManager
from astream.kvcache.paged_cache import PagedKVCache
from astream.kvcache.sizing import CachePlan, check_max_model_len, plan_cache
from astream.models.config import ModelConfig
from astream.models.loader import LoadedModel, ProgressFn, load_model, open_checkpoint, resolve_model_path
from astream.ops.attention import select_backend
from astream.runtime.device import DeviceRuntime
from astream.sampling import SamplingParams
from astream.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from astream.sequence import Sequence
from astream.text import IncrementalDetokenizer, RequestText
from astream.tokenization import Prompt, prompt_to_ids, stop_token_ids

log = logging.getLogger("astream")


@dataclass(slots=True)
class TokenEvent:
    """One sampled token after detokenization and stop checks."""

    seq: Sequence
    token_id: int
    text: str
    finish_reason: str | None


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
        checkpoint = open_checkpoint(path)
        model_config = ModelConfig.from_hf(checkpoint.hf_config)
        check_max_model_len(config, model_config)          # fail before the slow part
        model = load_model(checkpoint, dtype, device, progress)
        plan = plan_cache(config, model_config, dtype, device)    # sized after the weights
        cache = PagedKVCache.allocate(model.decoder.config, plan.num_blocks, plan.block_size, dtype, device)
        scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, plan.max_num_batched_tokens, plan.max_model_len),
            BlockManager(plan.num_blocks, plan.block_size, config.enable_prefix_caching))
        runtime = DeviceRuntime(device)
        generator = torch.Generator(device=device)
        generator.manual_seed(config.seed)
        runner = ModelRunner(model.decoder, cache, runtime, generator)
        if device.type == "cuda" and not config.enforce_eager:
            runner.graphs = _capture_graphs(config, plan, model, cache)
        eos = stop_token_ids(model.tokenizer, model.decoder.config.eos_token_ids)
        log.info("astream: %s on %s (%s), %d KV blocks of %d tokens, max_model_len %d, attention %s",
                 path.name, device, dtype, plan.num_blocks, plan.block_size, plan.max_model_len,
                 select_backend(device))
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

    def finish(self, request_id: str, reason: str) -> TokenEvent | None:
        """End a request from outside (abort, error); returns its last event, if it was live."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, reason)
        text = self.texts.pop(request_id)
        return TokenEvent(seq, -1, text.finish_early(reason), reason)

    # ---- steps ----------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        return self.scheduler.schedule()

    def execute(self, batch: ScheduledBatch, previous: StepOutput | None = None) -> StepOutput:
        output = self.runner.execute(batch, previous)
        for row, seq in enumerate(output.sampled):
            seq.num_pending += 1
            seq.pending_row = row
        return output

    def process(self, output: StepOutput) -> list[TokenEvent]:
        """Consume a finished step's sampled ids (its `ready` event must have completed)."""
        events = []
        for seq, token_id in zip(output.sampled, output.host_ids.tolist()):
            seq.num_pending -= 1
            if seq.is_finished:
                continue                   # ended while this step was in flight
            seq.output_token_ids.append(token_id)
            text = self.texts[seq.request_id]
            at_limit = seq.num_tokens >= self.plan.max_model_len
            delta = text.append(token_id, at_limit)
            self.scheduler.blocks.register_full_blocks(seq, seq.num_tokens - seq.num_pending)
            if text.finished:
                self.sequences.pop(seq.request_id, None)
                self.texts.pop(seq.request_id, None)
                self.scheduler.finish(seq, text.finished)
            events.append(TokenEvent(seq, token_id, delta, text.finished))
        return events

    def step(self) -> list[TokenEvent]:
        """Schedule, run and process one step synchronously."""
        batch = self.schedule()
        if batch is None:
            return []
        output = self.execute(batch)
        output.ready.synchronize()
        return self.process(output)

    def stats(self) -> dict:
        blocks = self.scheduler.blocks
        return {"kv_blocks_total": blocks.num_blocks, "kv_blocks_free": blocks.num_free,
                "kv_block_size": blocks.block_size, "prefix_cache_hits": blocks.prefix_hits,
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "steps": self.scheduler.steps, "preemptions": self.scheduler.preemptions,
                "max_model_len": self.plan.max_model_len}


def _capture_graphs(config: EngineConfig, plan: CachePlan, model: LoadedModel,
                    cache: PagedKVCache) -> DecodeGraphs:
    graphs = DecodeGraphs(model.decoder, cache, min(config.cuda_graph_max_batch, config.max_num_seqs),
                          max_blocks_per_seq=-(-plan.max_model_len // plan.block_size),
                          max_context=plan.max_model_len)
    with torch.inference_mode():
        graphs.capture()
    return graphs
