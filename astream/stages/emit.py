"""Stage: sampled ids reach the host, become text, and go to each request's channel."""

from __future__ import annotations

from anyio.streams.memory import MemoryObjectReceiveStream

from astream.executor.runner import StepOutput
from astream.runtime.events import wait_event
from astream.stages.context import StageContext


async def emit_stage(ctx: StageContext, inbox: MemoryObjectReceiveStream) -> None:
    async with inbox:
        async for result in inbox:
            if isinstance(result, StepOutput):
                await wait_event(result.ready)
                events = ctx.core.process(result)
                _report_prefill_progress(ctx, result)
            else:
                events = result.events
            for event in events:
                if not ctx.registry.deliver(event):       # the consumer went away
                    ctx.core.finish(event.seq.request_id, "abort")
            ctx.step_slots.release()
            ctx.wake.notify()


def _report_prefill_progress(ctx: StageContext, output: StepOutput) -> None:
    for item in output.batch.items:
        seq = item.seq
        if not item.sample and not seq.is_finished:
            ctx.registry.send_progress(seq.request_id, item.start + item.num_tokens,
                                       seq.num_prompt_tokens)
