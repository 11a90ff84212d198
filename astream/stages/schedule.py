"""Stage: form the next batch once a step slot is free and there is work.

A batch is scheduled only after the previous one has been launched, so
preemption never pulls blocks from under a batch whose inputs are not yet taken.

A long prefill step runs alone: the next batch is formed only once it has been emitted.
Scheduled while it runs, the next batch would be fixed before requests that arrive
meanwhile could join it, and a short prompt arriving during a long prefill would wait
for two long steps, not one. Such a step keeps the device busy for tens of
milliseconds, so the host's few milliseconds of scheduling between the two cost little;
decode steps, where they would cost much, stay pipelined.
"""

from __future__ import annotations

import time

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from astream.stages.context import STEPS_IN_FLIGHT, StageContext, StepTicket

# A step whose prompt chunks carry at least this share of the step's token budget runs alone.
ALONE_SHARE = 2


async def schedule_stage(ctx: StageContext, outbox: MemoryObjectSendStream) -> None:
    alone_tokens = max(2, ctx.core.plan.max_num_batched_tokens // ALONE_SHARE)
    async with outbox:
        previous_alone = False
        while True:
            await ctx.step_slots.acquire()
            if previous_alone:          # every other slot too: nothing is in flight any more
                for _ in range(STEPS_IN_FLIGHT - 1):
                    await ctx.step_slots.acquire()
                for _ in range(STEPS_IN_FLIGHT - 1):
                    ctx.step_slots.release()
            batch = None
            while batch is None:
                ctx.core.resume_caught_up()
                batch = ctx.core.schedule()
                if batch is None:
                    await ctx.wake.wait()
            ctx.scheduled_at[batch.step] = time.perf_counter()
            ticket = StepTicket(batch, anyio.Event())
            await outbox.send(ticket)
            await ticket.launched.wait()
            previous_alone = batch.prefill_tokens >= alone_tokens
