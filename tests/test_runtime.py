"""The runtime's awaitables: a step program driven on the loop gives other tasks turns."""

from __future__ import annotations

import anyio
import pytest

from astream.runtime.device import CompletedEvent
from astream.runtime.events import CHECKPOINT_EVERY, drive


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_a_long_step_of_complete_events_still_lets_the_loop_run():
    layers, turns = 36, []

    def program():
        for layer in range(layers):
            turns.append(("layer", layer))
            yield CompletedEvent()
        return "done"

    async def neighbour():
        while True:
            turns.append(("other", None))
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as group:
        group.start_soon(neighbour)
        await anyio.lowlevel.checkpoint()
        assert await drive(program(), run_ahead=4) == "done"
        group.cancel_scope.cancel()
    others_during = [i for i, (kind, _) in enumerate(turns) if kind == "other"
                     and 0 < i < len(turns) - 1]
    assert len(others_during) >= layers // CHECKPOINT_EVERY - 1
