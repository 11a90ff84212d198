"""Stage: hand tokenized requests to the scheduler (which checks them against max_model_len)."""

from __future__ import annotations

from anyio.streams.memory import MemoryObjectReceiveStream

from astream.stages.context import StageContext


async def admit_stage(ctx: StageContext, inbox: MemoryObjectReceiveStream) -> None:
    async with inbox:
        async for admission in inbox:
            handle = admission.handle
            if ctx.registry.handles.get(handle.request_id) is not handle:
                continue                                  # aborted while queued
            try:
                handle.seq = ctx.core.add_request(handle.request_id, admission.prompt_ids,
                                                  admission.params)
            except ValueError as exc:
                ctx.registry.reject(handle, exc)
                continue
            handle.prompt_tokens = len(admission.prompt_ids)
            ctx.wake.notify()
