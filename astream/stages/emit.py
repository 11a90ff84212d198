"""Stage: sampled ids reach the host; the core turns them into text for each request's channel."""

from __future__ import annotations

import time

from anyio.streams.memory import MemoryObjectReceiveStream

from astream.core.engine_core import StepOutput
from astream.runtime.events import wait_event
from astream.stages.context import StageContext


async def emit_stage(ctx: StageContext, inbox: MemoryObjectReceiveStream) -> None:
    async with inbox:
        async for result in inbox:
            if isinstance(result, StepOutput):          # a failed step was settled in forward
                await wait_event(result.ready)
                ctx.core.process(result)
            batch = result.batch
            scheduled = ctx.scheduled_at.pop(batch.step, None)
            if scheduled is not None:
                ctx.metrics.step(time.perf_counter() - scheduled, batch.prefill_tokens)
            ctx.step_slots.release()
            ctx.wake.notify()
