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
from typing import Callable, Generator, Protocol, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

T = TypeVar("T")

# A step program gives the loop a turn after this many of its yields (layers), even where
# their events are already complete. Enqueueing a long prefill layer costs the host about
# 0.7 ms, and every hop of a request on its way in and of its tokens on the way out waits
# for the stretch running: a turn every layer keeps that wait near a millisecond (every
# fourth added 20-50 ms to the first token of short requests during long prefills,
# docs/BENCHMARKS.md, "Serving"). Graph-replayed decode steps yield nothing and pay nothing.
CHECKPOINT_EVERY = 1


class Event(Protocol):
    """A point in a device stream: `torch.cuda.Event`, or the CPU's always-complete stand-in."""

    def query(self) -> bool:
        """True once the work queued before the event has finished."""

    def synchronize(self) -> None:
        """Block the calling thread until then."""


async def wait_event(event: Event) -> None:
    if event.query():
        return
    await anyio.to_thread.run_sync(event.synchronize, abandon_on_cancel=True)


async def run_off_loop(fn: Callable[..., T], *args, limiter: anyio.CapacityLimiter | None = None) -> T:
    """Run blocking host work (CPU compute, long tokenization) in a worker thread."""
    return await anyio.to_thread.run_sync(fn, *args, limiter=limiter)


async def drive(program: Generator[Event, None, T], run_ahead: int) -> T:
    """Run a step program that yields device events, keeping the host at most `run_ahead`
    yields ahead of the device, so its launch queue never fills and blocks the loop."""
    in_flight: deque = deque()
    yields = 0
    try:
        event = next(program)
        while True:
            in_flight.append(event)
            yields += 1
            if len(in_flight) > run_ahead:
                await wait_event(in_flight.popleft())
            if yields % CHECKPOINT_EVERY == 0:
                await anyio.lowlevel.checkpoint()
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
