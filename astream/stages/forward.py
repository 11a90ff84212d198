"""Stage: run a batch's prefill chunks and decode step on the device.

On CUDA the forward pass is only enqueued here, so this returns long before the
GPU finishes; on the CPU it computes in a worker thread so the event loop stays
free for other requests and connections.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from astream.core import TokenEvent
from astream.runtime.events import drive
from astream.stages.context import StageContext

log = logging.getLogger("astream")

# How many layers the host may enqueue ahead of the device in a layer-by-layer step.
LAYERS_AHEAD = 4


@dataclass(slots=True)
class FailedStep:
    events: list[TokenEvent]


async def forward_stage(ctx: StageContext, inbox: MemoryObjectReceiveStream,
                        outbox: MemoryObjectSendStream) -> None:
    core, previous = ctx.core, None
    async with inbox, outbox:
        async for ticket in inbox:
            step = core.prepare(ticket.batch)
            if step is None:                              # everything in it ended meanwhile
                ticket.launched.set()
                ctx.step_slots.release()
                continue
            try:
                if core.runtime.is_cuda:
                    output = await drive(core.runner.program(step, previous), LAYERS_AHEAD)
                else:
                    output = await core.runtime.run(core.launch, step, previous)
            except Exception as exc:
                log.exception("step %d failed", step.batch.step)
                ticket.launched.set()
                await outbox.send(FailedStep(core.fail_step(step, exc)))
                continue
            previous = output
            ticket.launched.set()
            await outbox.send(output)
