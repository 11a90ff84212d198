"""Stage: prompt (text, ids or chat) -> token ids.

Short prompts are tokenized inline; long ones on worker threads, several at once,
so one huge prompt holds up neither the loop nor the prompts behind it.
"""

from __future__ import annotations

import time

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from astream.runtime.events import run_off_loop
from astream.stages import burst
from astream.stages.context import Admission, StageContext, Submission


async def tokenize_stage(ctx: StageContext, inbox: MemoryObjectReceiveStream,
                         outbox: MemoryObjectSendStream) -> None:
    limiter = anyio.CapacityLimiter(ctx.tokenizer_threads)
    async with inbox, outbox:
        async with anyio.create_task_group() as workers:     # closes before outbox does
            async for first in inbox:
                ready, since = [], time.perf_counter()
                for sub in burst.with_queued(first, inbox):
                    if not ctx.core.is_live(sub.request):
                        continue                              # aborted while queued
                    if _is_long(sub.prompt, ctx.long_prompt_chars):
                        workers.start_soon(_tokenize_off_loop, ctx, sub, outbox, limiter)
                        continue
                    admission = _tokenize(ctx, sub)
                    if admission is not None:
                        ready.append(admission)
                    if time.perf_counter() - since > burst.TIME_SLICE_S:
                        # Many string prompts: let the step in flight be launched and read.
                        await outbox.send(ready)
                        ready, since = [], time.perf_counter()
                if ready:
                    await outbox.send(ready)                  # the burst, admitted as one


def _tokenize(ctx: StageContext, sub: Submission) -> Admission | None:
    try:
        return Admission(sub.request, ctx.core.tokenize(sub.prompt))
    except Exception as exc:                                  # a bad prompt: this request only
        ctx.core.reject(sub.request, exc)
        return None


async def _tokenize_off_loop(ctx: StageContext, sub: Submission, outbox: MemoryObjectSendStream,
                             limiter: anyio.CapacityLimiter) -> None:
    try:
        ids = await run_off_loop(ctx.core.tokenize, sub.prompt, limiter=limiter)
    except Exception as exc:
        ctx.core.reject(sub.request, exc)
        return
    await outbox.send([Admission(sub.request, ids)])


def _is_long(prompt, limit: int) -> bool:
    if isinstance(prompt, str):
        return len(prompt) > limit
    if prompt and isinstance(prompt[0], dict):
        return sum(len(str(m.get("content", ""))) for m in prompt) > limit
    return False
