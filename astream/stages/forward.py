"""Stage: run a batch's prefill chunks and decode step on the device.

On CUDA the forward pass is only enqueued here, so this returns long before the
GPU finishes; on the CPU it computes in a worker thread so the event loop stays
free for other requests and connections.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from astream.base.errors import TensorParallelError
from astream.core.engine_core import ScheduledBatch
from astream.runtime.events import drive
from astream.stages.context import StageContext

log = logging.getLogger("astream")

# How many layers the host may enqueue ahead of the device in a layer-by-layer step.
LAYERS_AHEAD = 4


@dataclass(slots=True, frozen=True)
class FailedStep:
    """A step that raised; the core has already ended or requeued its sequences."""

    batch: ScheduledBatch


async def forward_stage(ctx: StageContext, inbox: MemoryObjectReceiveStream,
                        outbox: MemoryObjectSendStream) -> None:
    core, previous = ctx.core, None
    async with inbox, outbox:
        async for ticket in inbox:
            step = None
            try:
                # Preparing is inside the fault isolation too: whatever a batch holds, a
                # failure ends (or retries alone) only the sequences in it.
                step = core.prepare(ticket.batch)
                if step is None:                          # everything in it ended meanwhile
                    ctx.scheduled_at.pop(ticket.batch.step, None)
                    ticket.launched.set()
                    ctx.step_slots.release()
                    continue
                if core.runtime.is_cuda:
                    output = await drive(core.program(step, previous), LAYERS_AHEAD)
                else:
                    output = await core.runtime.run(core.launch, step, previous)
            except TensorParallelError:             # the ranks are out of step: the engine stops
                ticket.launched.set()
                raise
            except Exception as exc:
                log.exception("step %d failed", ticket.batch.step)
                ticket.launched.set()
                core.fail_step(ticket.batch, step, exc)
                await outbox.send(FailedStep(ticket.batch))
                continue
            previous = output
            ticket.launched.set()
            await outbox.send(output)
