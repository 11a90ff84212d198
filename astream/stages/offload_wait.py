"""Stage: await the device-to-host copies of a step's new KV (host offload).

With the cache resident on the device there is nothing to wait for, so steps pass
straight through.
"""

from __future__ import annotations

from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from astream.core.engine_core import StepOutput
from astream.runtime.events import wait_event
from astream.stages.context import StageContext


async def offload_wait_stage(ctx: StageContext, inbox: MemoryObjectReceiveStream,
                             outbox: MemoryObjectSendStream) -> None:
    async with inbox, outbox:
        async for result in inbox:
            if isinstance(result, StepOutput):
                for event in result.offloaded:
                    await wait_event(event)
            await outbox.send(result)
