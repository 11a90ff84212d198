"""EngineCore: requests, scheduler and runner assembled, with no event loop.

The core owns every live request (`requests`, one record each: core.request) and is the
one place that starts and ends them; their output goes to each request's sink. Nothing
else keeps a request across steps: the scheduler holds its sequences while they wait or
run, and a step's batch lives for that step. The async Engine drives the
core from its stages; `step()` drives it synchronously (tests, benchmarks).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field

from astream.base.config import EngineConfig
from astream.base.errors import PromptTooLongError
from astream.base.outputs import TokenLogprob
from astream.base.sampling import SamplingParams
from astream.core.request import Choice, ListSink, Request, RequestSink
from astream.core.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from astream.core.sequence import Sequence
from astream.executor.build import build_runner, captures_graphs, graph_spec, kv_format
from astream.executor.cache_plan import plan_runner_cache
from astream.executor.runner import ModelRunner, PreparedStep, StepOutput, StepProgram
from astream.kvcache.block_manager import BlockManager
from astream.kvcache.sizing import CachePlan, check_max_model_len
from astream.models.config import ModelConfig
from astream.models.loader import LoadedModel, ProgressFn, load_model, open_checkpoint, resolve_model_path
from astream.models.tensor_parallel import check_tensor_parallel
from astream.ops.attention import select_backend
from astream.ops.backends import CUDNN_SHAPE_STEP
from astream.ops.triton_warmup import start_cache_key_warmup
from astream.parallel.group import rank_device
from astream.parallel.workers import WorkerGroup
from astream.policies import check_policy_mode, make_policy
from astream.runtime.device import DeviceRuntime
from astream.text.request_text import IncrementalDetokenizer, RequestText
from astream.text.tokenization import Prompt, PromptBound, prompt_to_ids, stop_token_ids

__all__ = ["EngineCore", "PreparedStep", "ScheduledBatch", "StepOutput", "StepProgram"]

log = logging.getLogger("astream")

_MAX_FAULTS = 4          # a sequence in this many failed steps fails even in company
CLOSE_DRAIN_S = 60.0     # closing waits at most this long for the device to go idle


@dataclass(slots=True)
class EngineCore:
    config: EngineConfig
    plan: CachePlan
    model: LoadedModel
    runtime: DeviceRuntime
    scheduler: Scheduler
    runner: ModelRunner
    eos_ids: frozenset[int]
    prompt_bound: PromptBound            # a prompt's fewest possible tokens, from its size
    workers: WorkerGroup | None = None   # the other tensor-parallel ranks
    requests: dict[str, Request] = field(default_factory=dict)
    _arrivals: itertools.count = field(default_factory=itertools.count)

    @classmethod
    def create(cls, config: EngineConfig, progress: ProgressFn | None = None) -> "EngineCore":
        device, dtype = config.torch_device(), config.torch_dtype()
        # Triton hashes itself once a process: let it do so while the weights load.
        triton_key = start_cache_key_warmup() if device.type == "cuda" else None
        path = resolve_model_path(config.model)
        checkpoint = open_checkpoint(path, config.load_format)
        shape = ModelConfig.from_hf(checkpoint.hf_config)
        check_max_model_len(config.max_model_len, shape)                # early
        workers = None
        if config.tensor_parallel_size > 1:
            check_tensor_parallel(shape, config.tensor_parallel_size)   # before any process starts
            device = rank_device(device, 0)
            workers = WorkerGroup.start(config, str(path), shape, device)
        try:
            tp = None if workers is None else workers.tp
            model = load_model(checkpoint, dtype, device, progress, config.tokenizer, tp)
            policy = make_policy(config.sparse_policy, config.sparse_budget)
            check_policy_mode(policy, config.offload)
            fmt = kv_format(config, model.decoder, model.tokenizer)
            plan = plan_runner_cache(config, model.decoder, policy, fmt)   # after the weights
            if workers is not None:
                plan = workers.agree(plan)
            runtime = DeviceRuntime(device)
            if triton_key is not None:
                triton_key.join()
            eos = frozenset(stop_token_ids(model.tokenizer, shape.eos_token_ids))
            runner = build_runner(config, plan, model.decoder, runtime, policy, fmt, eos)
            runner.followers = workers
            if workers is not None and captures_graphs(config, device):
                workers.install_graphs(graph_spec(config, plan, runner), runner)
        except BaseException as exc:
            named = None if workers is None else workers.stop_after(exc)
            if named is not None:
                raise named from exc
            raise
        align = plan.block_size if config.offload else 1
        scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, plan.max_num_batched_tokens, plan.max_model_len,
                            align_chunks_to=align, prefer_chunks_of=_chunk_step(runner, align),
                            short_prompt_tokens=short_prompt_tokens(plan.max_num_batched_tokens)),
            BlockManager(plan.num_blocks, plan.block_size, config.enable_prefix_caching))
        log.info("astream: %s on %s (%s), %d KV blocks of %d tokens (%s)%s, max_model_len %d, "
                 "attention %s%s", path.name, device, dtype, plan.num_blocks, plan.block_size,
                 str(fmt.dtype).removeprefix("torch."), " in host memory" if config.offload else "",
                 plan.max_model_len, select_backend(device),
                 f", tensor-parallel over {config.tensor_parallel_size} ranks" if workers else "")
        return cls(config, plan, model, runtime, scheduler, runner, eos,
                   PromptBound.of(model.tokenizer), workers)

    @property
    def tokenizer(self):
        return self.model.tokenizer

    # ---- requests: open, tokenize, admit ------------------------------------------------

    def open_request(self, request_id: str, params: SamplingParams, sink: RequestSink,
                     client: str = "") -> Request:
        """Register a request; its output goes to `sink`. Raises ValueError for a live id."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use by a live request")
        choices = [Choice(RequestText(params, None, self.eos_ids)) for _ in range(params.n)]
        request = Request(request_id, params, sink, choices, client)
        self.requests[request_id] = request
        return request

    def is_live(self, request: Request) -> bool:
        return self.requests.get(request.request_id) is request

    def check_prompt_size(self, prompt: Prompt) -> None:
        """Refuse, before any tokenization, a prompt too large to fit in any case."""
        bound = self.prompt_bound.min_tokens(prompt)
        if bound >= self.plan.max_model_len:
            raise PromptTooLongError(f"prompt is too large: at least {bound} tokens, but "
                                     f"max_model_len is {self.plan.max_model_len}")

    def check_prompt_length(self, num_tokens: int) -> None:
        self.scheduler.check_prompt_length(num_tokens)

    def tokenize(self, prompt: Prompt) -> list[int]:
        return prompt_to_ids(self.tokenizer, prompt, self.model.decoder.config.vocab_size)

    def admit(self, request: Request, prompt_ids: list[int]) -> None:
        """Hand a tokenized request to the scheduler; a prompt it cannot take rejects it.

        With n > 1 the first choice computes the prompt alone; the others wait for its KV
        (see `_release_forks`) and then attach the prompt's full blocks from the prefix
        cache, computing only its last, partial block themselves."""
        if not self.is_live(request):
            return                                          # ended while it was tokenized
        prompt = list(prompt_ids)                           # the request's; its sequences share it
        try:
            seqs = [Sequence(request.request_id, prompt, request.params, next(self._arrivals),
                             request.client, index=index) for index in range(request.params.n)]
            detokenizers = [IncrementalDetokenizer.start(self.tokenizer, prompt) for _ in seqs]
            self.scheduler.add(seqs[0])
        except Exception as exc:                            # this request's fault alone
            self.reject(request, exc)
            return
        request.prompt_token_ids = prompt
        for choice, seq, detokenizer in zip(request.choices, seqs, detokenizers):
            choice.seq, choice.text.detokenizer = seq, detokenizer
        request.forks = seqs[1:]
        if not self.scheduler.blocks.enable_prefix_caching:
            self._release_forks(request)                    # nothing to share: no reason to wait
        # Its length is known and it fits: servers answer (or refuse) from this first item.
        request.sink.progress(request, 0, len(prompt))

    def _release_forks(self, request: Request) -> None:
        """The prompt's KV is written (or will not be shared): the other choices may start."""
        forks, request.forks = request.forks, []
        for seq in forks:
            self.scheduler.add(seq)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    client: str = "") -> ListSink:
        """Open and admit in one call, for synchronous callers; returns the request's output."""
        sink = ListSink()
        self.admit(self.open_request(request_id, params, sink, client), prompt_ids)
        if sink.error is not None:
            raise sink.error
        return sink

    # ---- requests: the ways they end ---------------------------------------------------------

    def reject(self, request: Request, error: Exception) -> None:
        """End a request that failed before producing anything; its consumer gets `error`."""
        if self.is_live(request):
            del self.requests[request.request_id]
            for choice in request.choices:
                choice.text.finish_early("error")
            request.last_ended = len(request.choices) - 1
            request.sink.reject(request, error)

    def finish(self, request: Request, reason: str, error: str | None = None) -> None:
        """End a live request wherever it is (queued, waiting or running): its blocks return,
        and its consumer gets, for each choice still going, the text that was complete and
        the finish reason."""
        if not self.is_live(request):
            return
        del self.requests[request.request_id]
        request.forks = []
        for index, choice in enumerate(request.choices):
            if not choice.finished:
                if choice.seq is not None:                  # admitted
                    self.scheduler.finish(choice.seq)
                text = choice.text.finish_early(reason)
                request.last_ended = index
                request.sink.token(request, -1, text, reason, error, index)

    def abort(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, "abort")

    def finish_all(self, reason: str, error: str | None = None) -> None:
        for request in list(self.requests.values()):
            self.finish(request, reason, error)

    def fail_step(self, batch: ScheduledBatch, step: PreparedStep | None, exc: BaseException) -> None:
        """Preparing or running a batch raised (`step` is None if preparing did). Alone, its
        sequence failed; in company, each one is recomputed alone, so a repeat is its own."""
        if step is not None:
            self.scheduler.dropped(step.sampled)
        seqs = [item.seq for item in batch.items if not item.seq.is_finished]
        message = f"{type(exc).__name__}: {exc}"
        for seq in seqs:
            if seq.is_finished:                # another choice of its request failed it
                continue
            if len(seqs) == 1 or self.scheduler.record_fault(seq) >= _MAX_FAULTS:
                log.warning("request %s failed in a step: %s", seq.request_id, message)
                self.finish(self.requests[seq.request_id], "error", message)
            else:
                self.scheduler.isolate(seq)

    # ---- backpressure -------------------------------------------------------------------------

    def resume_caught_up(self) -> None:
        """Resume paused requests whose consumers have read half of their backlog."""
        limit = self.config.stream_buffer_tokens // 2
        for seq in self.scheduler.paused():
            request = self.requests.get(seq.request_id)
            if request is not None and request.sink.backlog <= limit:
                self.scheduler.resume(seq)

    # ---- steps ----------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        batch = self.scheduler.schedule()
        if batch is not None and batch.admitted:
            now = time.perf_counter()
            for seq in batch.admitted:
                request = self.requests.get(seq.request_id)
                if request is not None and request.started_at is None:
                    request.started_at = now
        return batch

    def prepare(self, batch: ScheduledBatch) -> PreparedStep | None:
        """Build the step's inputs; from here its sampled tokens count as pending."""
        step = self.runner.prepare(batch)
        if step is not None:
            self.scheduler.launched(step.sampled)
        return step

    def program(self, step: PreparedStep, previous: StepOutput | None = None) -> StepProgram:
        """The step as a generator of device events (see executor.runner), for async drivers."""
        return self.runner.program(step, previous)

    def launch(self, step: PreparedStep, previous: StepOutput | None = None) -> StepOutput:
        return self.runner.launch(step, previous)

    def process(self, output: StepOutput) -> int:
        """Consume a finished step (its `ready` event must have completed): deliver each
        sampled token and prefill progress. Returns how many tokens were delivered."""
        if self.workers is not None:
            self.workers.check()               # a rank that died makes this step's ids garbage
        register = self.scheduler.blocks.register_full_blocks
        for item in output.batch.items:
            if not item.seq.is_finished:       # this step's KV is written: cacheable now
                register(item.seq, item.start + item.num_tokens)
        delivered = 0
        arrived, requests, max_len = self.scheduler.token_arrived, self.requests, self.plan.max_model_len
        logprobs = output.logprobs
        for row, (seq, token_id) in enumerate(zip(output.sampled, output.host_ids.tolist())):
            if arrived(seq, token_id):
                request = requests[seq.request_id]
                if request.forks:              # the first choice's prompt KV is written
                    self._release_forks(request)
                logprob = None if logprobs is None or seq.params.logprobs is None else \
                    logprobs.token(row, token_id, seq.params.logprobs)
                delivered += self._deliver_token(request, request.choices[seq.index], token_id,
                                                 logprob, max_len)
        for item in output.batch.items:
            if item.sample:                    # a decode, or a prompt's last chunk: no progress
                continue
            request = requests.get(item.seq.request_id)
            if request is not None and request.seq is item.seq:
                request.sink.progress(request, item.start + item.num_tokens, item.seq.num_prompt_tokens)
        return delivered

    def _deliver_token(self, request: Request, choice: Choice, token_id: int,
                       logprob: TokenLogprob | None, max_len: int) -> int:
        seq = choice.seq
        try:
            delta = choice.text.append(token_id, len(seq.output_token_ids) >= seq.params.max_tokens
                                       or seq.num_tokens >= max_len)
        except Exception as exc:               # a detokenizer or stop-check fault: this request only
            log.warning("request %s failed in output processing: %r", seq.request_id, exc)
            self.finish(request, "error", f"{type(exc).__name__}: {exc}")
            return 0
        reason = choice.text.finished
        if reason is not None:
            self.scheduler.finish(seq)
            request.last_ended = seq.index
            if request.done:
                del self.requests[request.request_id]
        if not request.sink.token(request, token_id, delta, reason, None, seq.index, logprob):
            self.finish(request, "abort")       # the consumer is gone
        elif reason is None and request.sink.backlog >= self.config.stream_buffer_tokens:
            self.scheduler.pause(seq)
        return 1

    def step(self) -> int:
        """Schedule, run and process one step synchronously; returns tokens delivered."""
        batch = self.schedule()
        step = self.prepare(batch) if batch is not None else None
        if step is None:
            return 0
        output = self.launch(step)
        output.ready.synchronize()
        return self.process(output)

    def close(self) -> None:
        """Wait for the device (a bounded time), then give back what the engine pinned in host
        memory; where the device did not go idle, that memory stays pinned (a copy may still
        write to it)."""
        drained = self.runtime.drain(CLOSE_DRAIN_S)
        if not drained:
            log.warning("astream: the device did not go idle within %.0f s of closing; the "
                        "host KV pool stays pinned", CLOSE_DRAIN_S)
        if self.runner.offload is not None and drained:
            self.runner.offload.free_host_pool()
        self.runtime.close()
        if self.workers is not None:
            # A device that did not go idle most likely waits in a collective on a peer.
            self.workers.close(clean=drained)

    def stats(self) -> dict:
        blocks = self.scheduler.blocks
        return {"kv_blocks_total": blocks.num_blocks, "kv_blocks_free": blocks.num_free,
                "kv_block_size": blocks.block_size, "prefix_cache_hits": blocks.prefix_hits,
                "requests": len(self.requests),
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting) + len(self.scheduler.isolated),
                "paused": len(self.scheduler.paused()),
                "steps": self.scheduler.steps, "preemptions": self.scheduler.preemptions,
                "max_model_len": self.plan.max_model_len,
                "max_num_batched_tokens": self.scheduler.config.max_num_batched_tokens,
                "kv_cache_dtype": str(self.runner.kv_format.dtype).removeprefix("torch."),
                "offload": self.config.offload, "sparse_policy": self._policy_name(),
                "graph_steps": self.runner.graphs.steps if self.runner.graphs is not None else 0,
                **self.runner.policy.stats(), **self._offload_stats()}

    def _policy_name(self) -> str:
        spec = self.config.sparse_policy
        return spec if isinstance(spec, str) else spec.name

    def _offload_stats(self) -> dict:
        engine = self.runner.offload
        if engine is None:
            return {}
        return {"offload_tail_blocks_used": len(self.scheduler.running),
                "offload_ring_slots": len(engine.slots), "offload_slot_blocks": engine.slot_blocks,
                "offload_bytes_loaded": engine.bytes_loaded,
                "offload_device_layers": sorted(engine.device_layers),
                "offload_bytes_offloaded": engine.bytes_offloaded}


def short_prompt_tokens(budget: int) -> int:
    """Prompts the scheduler puts first: up to 256 tokens, or an eighth of a step's budget
    when that is more, and never more than half of it (docs/ENGINE.md, "Scheduler")."""
    return min(max(256, budget // 8), budget // 2)


def _chunk_step(runner: ModelRunner, align: int) -> int:
    """Where prefill chunks should end: cuDNN prefill takes only parts of repeating shapes
    (multiples of CUDNN_SHAPE_STEP), so a chunk cut by a busy step's leftover budget would
    leave the rest of its prompt on the slower kernel."""
    if not runner.backends.cudnn_prefill:
        return align
    return math.lcm(align, CUDNN_SHAPE_STEP)
