"""Stage: hand tokenized requests to the core's scheduler (which checks them against max_model_len)."""

from __future__ import annotations

from anyio.streams.memory import MemoryObjectReceiveStream

from astream.stages import burst
from astream.stages.context import StageContext


async def admit_stage(ctx: StageContext, inbox: MemoryObjectReceiveStream) -> None:
    async with inbox:
        async for first in inbox:
            for admissions in burst.with_queued(first, inbox):  # one step takes them all
                for admission in admissions:
                    ctx.core.admit(admission.request, admission.prompt_ids)
            ctx.wake.notify()
