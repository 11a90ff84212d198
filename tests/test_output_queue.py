"""The per-request output queue: order, end, a consumer that leaves, cancellation, backends."""

from __future__ import annotations

import anyio
import pytest

from astream.stages.output_queue import OutputQueue
from async_backends import BACKENDS


@pytest.mark.parametrize("anyio_backend", BACKENDS)
@pytest.mark.anyio
async def test_a_waiting_consumer_gets_every_item_in_order_then_the_end():
    queue, seen = OutputQueue(), []

    async def consume() -> None:
        async for item in queue:
            seen.append(item)

    async with anyio.create_task_group() as group:
        group.start_soon(consume)
        for i in range(5):
            await anyio.sleep(0.001)             # the consumer waits before each item
            assert queue.put(i)
        queue.put(5)
        queue.put(6)                             # two at once: taken without waiting
        queue.close()
    assert seen == list(range(7))
    assert len(queue) == 0


@pytest.mark.parametrize("anyio_backend", BACKENDS)
@pytest.mark.anyio
async def test_a_cancelled_waiter_leaves_the_queue_usable():
    queue = OutputQueue()
    with anyio.move_on_after(0.01):
        await queue.__anext__()                  # nothing comes: cancelled while waiting
    queue.put("late")                            # wakes nobody, raises nothing
    assert await queue.__anext__() == "late"


@pytest.mark.parametrize("anyio_backend", BACKENDS)
@pytest.mark.anyio
async def test_a_cancelled_consumer_stops_at_its_next_item_even_with_items_queued():
    queue = OutputQueue()
    for i in range(3):
        queue.put(i)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await queue.__anext__()
        pytest.fail("not a cancellation point")
    assert len(queue) == 3


@pytest.mark.anyio
async def test_a_consumer_that_left_drops_what_is_queued_and_what_comes_later():
    queue = OutputQueue()
    queue.put(1)
    queue.abandon()
    assert len(queue) == 0
    assert not queue.put(2)
    with pytest.raises(StopAsyncIteration):
        await queue.__anext__()
