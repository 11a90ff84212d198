"""Engine: the async front door. Runs the stage graph under anyio (asyncio, uvloop or trio).

    async with Engine() as engine:
        async for tok in engine.stream("Hello", SamplingParams(max_tokens=32)):
            print(tok.text, end="")
"""

from __future__ import annotations

import gc
import logging
import sys
import uuid
from typing import AsyncIterator, Callable

import anyio
import torch

from astream.base.config import EngineConfig
from astream.base.errors import EngineClosedError
from astream.base.metrics import EngineMetrics
from astream.base.outputs import Completion, CompletionOutput, Progress, StreamToken
from astream.base.sampling import SamplingParams
from astream.core.engine_core import EngineCore
from astream.core.request import Request
from astream.engine.load_progress import LoadProgress, wants_progress
from astream.engine.request_stream import RequestStream, stream_request
from astream.policies import check_policy_mode, make_policy
from astream.runtime.events import Notifier, run_off_loop
from astream.stages import graph
from astream.stages.channel import Rejected, RequestChannel
from astream.stages.context import STEPS_IN_FLIGHT, StageContext, Submission
from astream.text.tokenization import Prompt

log = logging.getLogger("astream")


class Engine:
    def __init__(self, model: str | None = None, *, load_progress: Callable[[int, int], None] | None = None,
                 **config) -> None:
        self.config = self.check_options(model, **config)
        self.core: EngineCore | None = None
        self._load_progress = load_progress
        self._ctx: StageContext | None = None
        self._host = None                         # task group holding the stages' host task
        self._stages: anyio.CancelScope | None = None
        self._submit = None
        self._fault: BaseException | None = None
        self.metrics = EngineMetrics()            # requests, tokens and latencies, for /metrics

    @staticmethod
    def check_options(model: str | None = None, **config) -> EngineConfig:
        """Validate engine options without loading anything: the EngineConfig they make, or a
        TypeError / ValueError naming the bad option."""
        engine_config = EngineConfig.from_kwargs(model, **config)
        if engine_config.node_rank > 0:
            raise ValueError(f"node_rank {engine_config.node_rank} runs only tensor-parallel "
                             "ranks and no engine: start that host with `astream worker`")
        check_policy_mode(make_policy(engine_config.sparse_policy, engine_config.sparse_budget),
                          engine_config.offload)
        return engine_config

    # ---- lifecycle ------------------------------------------------------------------

    async def __aenter__(self) -> "Engine":
        display = LoadProgress.start(self.config.model, wants_progress(self.config.show_progress, sys.stderr))

        def progress(done: int, total: int) -> None:
            display.weights(done, total)
            if self._load_progress is not None:
                self._load_progress(done, total)

        try:
            self.core = await run_off_loop(EngineCore.create, self.config, progress)
        finally:
            display.close()
        display.finish()
        self._ctx = StageContext(self.core, Notifier(), anyio.Semaphore(STEPS_IN_FLIGHT),
                                 self.metrics)
        self._host = anyio.create_task_group()
        await self._host.__aenter__()
        try:
            # The stages run in a task group of their own, inside one host task: a fault
            # cancels that group only, never the caller's code between enter and exit.
            await self._host.start(self._run_stages)
        except BaseException:
            await self.__aexit__(*sys.exc_info())
            raise
        return self

    async def __aexit__(self, *exc_info) -> None:
        if self._host is None:
            return
        if self._stages is not None:
            self._stages.cancel()
        try:
            # The caller's own exception, if any, propagates unchanged: the host group
            # never sees it, so it neither wraps it in a group nor cancels anything.
            await self._host.__aexit__(None, None, None)
        finally:
            self._host = None
            self.core.finish_all("abort")
            self.core.close()
            self.core = self._ctx = self._submit = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    async def _run_stages(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as stages:
            self._stages = stages.cancel_scope
            self._start_stages(stages)
            task_status.started()

    def _start_stages(self, group) -> None:
        ends: dict[tuple[str, str], tuple] = {}
        for channel in graph.CHANNELS:
            ends[(channel.source, channel.target)] = anyio.create_memory_object_stream(channel.capacity)
        self._submit = ends[("submit", "tokenize")][0]
        for stage in graph.STAGES:
            inboxes = [ends[(c.source, c.target)][1] for c in graph.CHANNELS if c.target == stage.name]
            outboxes = [ends[(c.source, c.target)][0] for c in graph.CHANNELS if c.source == stage.name]
            group.start_soon(self._supervise, stage, *inboxes, *outboxes, name=stage.name)

    async def _supervise(self, stage: graph.Stage, *channel_ends) -> None:
        try:
            await stage.run(self._ctx, *channel_ends)
        except Exception as exc:                  # a bug, not a request's fault: stop cleanly
            log.exception("stage %s crashed; the engine stops", stage.name)
            self._fault = exc
            self.core.finish_all("error", f"engine stopped: {type(exc).__name__}: {exc}")
            self._stages.cancel()

    # ---- requests -------------------------------------------------------------------

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               request_id: str | None = None, *, progress: bool = False, client: str = ""
               ) -> AsyncIterator[StreamToken]:
        """Tokens of one request as they are produced. Leaving the loop early aborts it.

        A bad prompt raises ValueError here. With progress=True, `Progress` items
        report long prefills between tokens. With params.n > 1 the n completions' tokens
        interleave, each naming its completion in `choice`; the stream ends after the last
        completion's final token. Requests of one `client` share a fair part
        of the running slots with those of other clients (see docs/ENGINE.md).
        """
        return stream_request(self, prompt, params, request_id, progress, client)

    async def request(self, prompt: Prompt, params: SamplingParams | None = None,
                      request_id: str | None = None, *, progress: bool = False,
                      client: str = "") -> RequestStream:
        """Submit a request and return its open stream (for servers that need its usage and timing).

        Raises ValueError at once for a request id that is already live, and
        PromptTooLongError for a prompt too large to fit whatever it tokenizes to.
        Close the stream (or leave `async with`) to abort the request.
        """
        request, channel = await self._open(prompt, params, request_id, client)
        return RequestStream(request, self._follow(request, channel, progress), self._abort_request)

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None, *, client: str = "") -> Completion:
        """The whole request: its n completions in `outputs`, the first one's fields also
        on the Completion itself."""
        request = await self.request(prompt, params, request_id, client=client)
        n = 1 if params is None else params.n
        outputs = [CompletionOutput(index) for index in range(n)]
        async with request:
            async for tok in request:
                outputs[tok.choice].add(tok)
        return Completion(request.request_id, request.prompt_token_ids, outputs)

    async def abort(self, request_id: str) -> None:
        """End a request with finish_reason "abort". Unknown or finished ids are a no-op."""
        if self.core is not None:
            self.core.abort(request_id)
            self._ctx.wake.notify()

    @property
    def running(self) -> bool:
        """True between start and close, unless an internal fault stopped the engine."""
        return self.core is not None and self._fault is None

    @property
    def tokenizer(self):
        """The model's tokenizer: a `TextTokenizer` (the part of transformers' interface
        astream uses, without transformers) for GGUF files and for folders whose
        tokenizer.json holds the whole pipeline, else a transformers tokenizer."""
        if self.core is None:
            raise EngineClosedError("the engine is not running")
        return self.core.tokenizer

    def stats(self) -> dict:
        if self.core is None:
            raise EngineClosedError("the engine is not running")
        stats = self.core.stats()
        stats["fault"] = None if self._fault is None else repr(self._fault)
        return stats

    @property
    def graph(self) -> str:
        return graph.render()

    async def _open(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None,
                    client: str) -> tuple[Request, RequestChannel]:
        if self.core is None or self._fault is not None:
            raise EngineClosedError("the engine is not running" if self._fault is None
                                    else f"the engine stopped after a fault: {self._fault!r}")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(client, str):
            raise TypeError(f"client must be a string, got {type(client).__name__}")
        self.core.check_prompt_size(prompt)
        request_id = request_id or uuid.uuid4().hex
        channel = RequestChannel(metrics=self.metrics)
        request = self.core.open_request(request_id, params, channel, client)
        try:
            await self._submit.send(Submission(request, prompt))
        except BaseException:                     # cancelled while queueing: leave nothing behind
            self.core.finish(request, "abort")
            raise
        return request, channel

    async def _follow(self, request: Request, channel: RequestChannel, progress: bool):
        ended = 0
        try:
            async for item in channel.queue:
                if isinstance(item, Rejected):
                    raise item.error
                if isinstance(item, Progress):
                    if progress:
                        yield item
                    continue
                if request.paused:
                    self._ctx.wake.notify()       # the backlog shrank; the scheduler may resume it
                yield item
                if item.finish_reason is not None:
                    ended += 1
                    if ended == request.params.n:
                        return
        finally:
            self._abort_request(request)
            channel.queue.abandon()

    def _abort_request(self, request: Request) -> None:
        """End `request` if it is still live (a no-op once it finished or the engine closed)."""
        if self.core is not None and self.core.is_live(request):
            self.core.finish(request, "abort")
            self._ctx.wake.notify()
