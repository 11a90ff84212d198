"""Stage: form the next batch once a step slot is free and there is work.

A batch is scheduled only after the previous one has been launched, so
preemption never pulls blocks from under a batch whose inputs are not yet taken.
"""

from __future__ import annotations

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from astream.stages.context import StageContext, StepTicket


async def schedule_stage(ctx: StageContext, outbox: MemoryObjectSendStream) -> None:
    async with outbox:
        while True:
            await ctx.step_slots.acquire()
            batch = None
            while batch is None:
                ctx.core.resume_caught_up()
                batch = ctx.core.schedule()
                if batch is None:
                    await ctx.wake.wait()
            ticket = StepTicket(batch, anyio.Event())
            await outbox.send(ticket)
            await ticket.launched.wait()
