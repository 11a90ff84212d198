"""Stage: prompt (text, ids or chat) -> token ids. Long prompts are tokenized off the loop thread."""

from __future__ import annotations

from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from astream.runtime.events import run_off_loop
from astream.stages.context import Admission, StageContext


async def tokenize_stage(ctx: StageContext, inbox: MemoryObjectReceiveStream,
                         outbox: MemoryObjectSendStream) -> None:
    async with inbox, outbox:
        async for sub in inbox:
            if ctx.registry.handles.get(sub.handle.request_id) is not sub.handle:
                continue                                  # aborted while queued
            try:
                if _is_long(sub.prompt, ctx.long_prompt_chars):
                    ids = await run_off_loop(ctx.core.tokenize, sub.prompt)
                else:
                    ids = ctx.core.tokenize(sub.prompt)
            except Exception as exc:                      # bad prompt: this request only
                ctx.registry.reject(sub.handle, exc)
                continue
            await outbox.send(Admission(sub.handle, ids, sub.params))


def _is_long(prompt, limit: int) -> bool:
    if isinstance(prompt, str):
        return len(prompt) > limit
    if prompt and isinstance(prompt[0], dict):
        return sum(len(str(m.get("content", ""))) for m in prompt) > limit
    return False
