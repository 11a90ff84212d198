"""Stage: prompt (text, ids or chat) -> token ids.

Short prompts are tokenized inline; long ones on worker threads, several at once,
so one huge prompt holds up neither the loop nor the prompts behind it.
"""

from __future__ import annotations

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
                for sub in burst.with_queued(first, inbox):
                    if not ctx.core.is_live(sub.request):
                        continue                              # aborted while queued
                    if _is_long(sub.prompt, ctx.long_prompt_chars):
                        workers.start_soon(_tokenize, ctx, sub, outbox, limiter)
                    else:
                        await _tokenize(ctx, sub, outbox, None)


async def _tokenize(ctx: StageContext, sub: Submission, outbox: MemoryObjectSendStream,
                    limiter: anyio.CapacityLimiter | None) -> None:
    try:
        if limiter is None:
            ids = ctx.core.tokenize(sub.prompt)
        else:
            ids = await run_off_loop(ctx.core.tokenize, sub.prompt, limiter=limiter)
    except Exception as exc:                                  # a bad prompt: this request only
        ctx.core.reject(sub.request, exc)
        return
    await burst.send(outbox, Admission(sub.request, ids))


def _is_long(prompt, limit: int) -> bool:
    if isinstance(prompt, str):
        return len(prompt) > limit
    if prompt and isinstance(prompt[0], dict):
        return sum(len(str(m.get("content", ""))) for m in prompt) > limit
    return False
