"""Device events as awaitables, and a wake-up signal between stages.

`await wait_event(e)` returns once the device work queued before `e` has
finished. A completed event returns at once. Otherwise one worker thread sleeps
in the driver's blocking synchronize (the events are created with blocking
sync, so the thread yields the core instead of spinning) and wakes the loop;
the event-loop thread itself never blocks on the device.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Generator, TypeVar

import anyio
import anyio.to_thread

T = TypeVar("T")


async def wait_event(event) -> None:
    if event.query():
        return
    await anyio.to_thread.run_sync(event.synchronize, abandon_on_cancel=True)


async def run_off_loop(fn: Callable[..., T], *args, limiter: anyio.CapacityLimiter | None = None) -> T:
    """Run blocking host work (CPU compute, long tokenization) in a worker thread."""
    return await anyio.to_thread.run_sync(fn, *args, limiter=limiter)


async def drive(program: Generator[object, None, T], run_ahead: int) -> T:
    """Run a step program that yields device events, keeping the host at most `run_ahead`
    yields ahead of the device, so its launch queue never fills and blocks the loop."""
    in_flight: deque = deque()
    try:
        event = next(program)
        while True:
            in_flight.append(event)
            if len(in_flight) > run_ahead:
                await wait_event(in_flight.popleft())
            event = program.send(None)
    except StopIteration as stop:
        return stop.value


@dataclass(slots=True)
class Notifier:
    """A level-triggered wake-up: notify() before wait() is not lost."""

    _event: anyio.Event = field(default_factory=anyio.Event)

    def notify(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
        self._event = anyio.Event()
