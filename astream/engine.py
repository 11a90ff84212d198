"""Engine: the async front door. Runs the stage graph under anyio (asyncio, uvloop or trio).

    async with Engine() as engine:
        async for tok in engine.stream("Hello", SamplingParams(max_tokens=32)):
            print(tok.text, end="")
"""

from __future__ import annotations

import gc
import logging
import uuid
from typing import AsyncIterator, Callable

import anyio
import torch

from astream.config import EngineConfig
from astream.core import EngineCore
from astream.outputs import Completion, StreamToken
from astream.runtime.events import Notifier, run_off_loop
from astream.sampling import SamplingParams
from astream.stages import graph
from astream.stages.context import STEPS_IN_FLIGHT, StageContext, Submission
from astream.stages.requests import Progress, Rejected, RequestHandle, RequestRegistry
from astream.tokenization import Prompt

log = logging.getLogger("astream")


class EngineClosedError(RuntimeError):
    """The engine is not running (not started, closed, or stopped by an internal fault)."""


class Engine:
    def __init__(self, model: str | None = None, *, load_progress: Callable[[int, int], None] | None = None,
                 **config) -> None:
        self.config = EngineConfig.from_kwargs(model, **config)
        self.core: EngineCore | None = None
        self._load_progress = load_progress
        self._ctx: StageContext | None = None
        self._task_group = None
        self._submit = None
        self._fault: BaseException | None = None

    # ---- lifecycle ------------------------------------------------------------------

    async def __aenter__(self) -> "Engine":
        self.core = await run_off_loop(EngineCore.create, self.config, self._load_progress)
        self._ctx = StageContext(self.core, RequestRegistry(self.config.stream_buffer_tokens),
                                 Notifier(), anyio.Semaphore(STEPS_IN_FLIGHT))
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._start_stages()
        return self

    async def __aexit__(self, *exc_info) -> None:
        if self._task_group is None:
            return
        self._task_group.cancel_scope.cancel()
        await self._task_group.__aexit__(None, None, None)
        self._task_group = None
        self._end_all("abort", None)
        self.core.close()
        self.core = self._ctx = self._submit = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _start_stages(self) -> None:
        ends: dict[tuple[str, str], tuple] = {}
        for channel in graph.CHANNELS:
            ends[(channel.source, channel.target)] = anyio.create_memory_object_stream(channel.capacity)
        self._submit = ends[("submit", "tokenize")][0]
        for stage in graph.STAGES:
            inboxes = [ends[(c.source, c.target)][1] for c in graph.CHANNELS if c.target == stage.name]
            outboxes = [ends[(c.source, c.target)][0] for c in graph.CHANNELS if c.source == stage.name]
            self._task_group.start_soon(self._supervise, stage, *inboxes, *outboxes, name=stage.name)

    async def _supervise(self, stage: graph.Stage, *channel_ends) -> None:
        try:
            await stage.run(self._ctx, *channel_ends)
        except Exception as exc:                  # a bug, not a request's fault: stop cleanly
            log.exception("stage %s crashed; the engine stops", stage.name)
            self._fault = exc
            self._end_all("error", f"engine stopped: {type(exc).__name__}: {exc}")
            self._task_group.cancel_scope.cancel()

    def _end_all(self, reason: str, error: str | None) -> None:
        for handle in list(self._ctx.registry.handles.values()):
            self._end_handle(handle, reason, error)

    def _end_handle(self, handle: RequestHandle, reason: str, error: str | None = None) -> None:
        """Finish a live request wherever it is: in the core, or still queued before it."""
        event = self.core.finish(handle.request_id, reason, error) if handle.seq is not None else None
        if event is not None:
            self._ctx.registry.deliver(event)
        else:
            self._ctx.registry.end_unadmitted(handle, reason)

    # ---- requests -------------------------------------------------------------------

    async def stream(self, prompt: Prompt, params: SamplingParams | None = None,
                     request_id: str | None = None, *, progress: bool = False
                     ) -> AsyncIterator[StreamToken]:
        """Tokens of one request as they are produced. Leaving the loop early aborts it.

        A bad prompt raises ValueError here. With progress=True, `Progress` items
        report long prefills between tokens.
        """
        request = await self.request(prompt, params, request_id, progress=progress)
        async with request:
            async for item in request:
                yield item

    async def request(self, prompt: Prompt, params: SamplingParams | None = None,
                      request_id: str | None = None, *, progress: bool = False) -> "RequestStream":
        """Submit a request and return its open stream (for servers that need its usage and timing).

        Raises ValueError at once for a request id that is already live.
        """
        handle = await self._open(prompt, params or SamplingParams(), request_id)
        return RequestStream(handle, self._follow(handle, progress))

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None) -> Completion:
        handle = await self._open(prompt, params or SamplingParams(), request_id)
        completion = Completion(handle.request_id, [])
        async for tok in self._follow(handle, progress=False):
            if tok.token_id >= 0:
                completion.token_ids.append(tok.token_id)
            completion.text += tok.text
            completion.finish_reason, completion.error = tok.finish_reason, tok.error
        if handle.seq is not None:
            completion.prompt_token_ids = list(handle.seq.prompt_token_ids)
        return completion

    async def _follow(self, handle: RequestHandle, progress: bool):
        try:
            async for item in handle.receive:
                if isinstance(item, Rejected):
                    raise item.error
                if isinstance(item, Progress):
                    if progress:
                        yield item
                    continue
                if handle.seq is not None and handle.seq.paused:
                    self._ctx.wake.notify()       # the backlog shrank; the scheduler may resume it
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if handle.finish_reason is None and self._ctx is not None:
                self._abort_handle(handle)

    async def abort(self, request_id: str) -> None:
        """End a request with finish_reason "abort". Unknown or finished ids are a no-op."""
        if self._ctx is None:
            return
        handle = self._ctx.registry.handles.get(request_id)
        if handle is not None:
            self._abort_handle(handle)

    @property
    def running(self) -> bool:
        """True between start and close, unless an internal fault stopped the engine."""
        return self.core is not None and self._fault is None

    def stats(self) -> dict:
        if self.core is None:
            raise EngineClosedError("the engine is not running")
        stats = self.core.stats()
        stats["requests"] = len(self._ctx.registry.handles)
        stats["fault"] = None if self._fault is None else repr(self._fault)
        return stats

    @property
    def graph(self) -> str:
        return graph.render()

    async def _open(self, prompt: Prompt, params: SamplingParams, request_id: str | None) -> RequestHandle:
        if self._ctx is None or self._fault is not None:
            raise EngineClosedError("the engine is not running" if self._fault is None
                                    else f"the engine stopped after a fault: {self._fault!r}")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        handle = self._ctx.registry.open(request_id or uuid.uuid4().hex)
        await self._submit.send(Submission(handle, prompt, params))
        return handle

    def _abort_handle(self, handle: RequestHandle) -> None:
        if self._ctx.registry.handles.get(handle.request_id) is not handle:
            return
        self._end_handle(handle, "abort")
        self._ctx.wake.notify()


class RequestStream:
    """One live request: iterate it for StreamTokens (and Progress items when asked for).

    Closing it (aclose, or leaving `async with`) before the last token aborts the request.
    """

    def __init__(self, handle: RequestHandle, items) -> None:
        self._handle = handle
        self._items = items

    @property
    def request_id(self) -> str:
        return self._handle.request_id

    @property
    def prompt_tokens(self) -> int:
        return self._handle.prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return self._handle.tokens_sent

    @property
    def finish_reason(self) -> str | None:
        return self._handle.finish_reason

    def timing(self) -> dict:
        """{"ttft_ms": ..., "tpot_ms": ...}; None where not yet measurable."""
        return self._handle.timing()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self):
        return await self._items.__anext__()

    async def aclose(self) -> None:
        await self._items.aclose()

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()
