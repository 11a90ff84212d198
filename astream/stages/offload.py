"""Stage: KV leaving the device. With the cache resident on the device there is nothing to move,
so steps pass straight through; with host offload this is where D2H completions are awaited."""

from __future__ import annotations

from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from astream.runtime.events import wait_event
from astream.stages.context import StageContext


async def offload_stage(ctx: StageContext, inbox: MemoryObjectReceiveStream,
                        outbox: MemoryObjectSendStream) -> None:
    async with inbox, outbox:
        async for result in inbox:
            for event in getattr(result, "offloaded", ()):
                await wait_event(event)
            await outbox.send(result)
