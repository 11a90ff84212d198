"""One request's output on its way from the core to its one consumer.

A deque with a single waiter, in place of an anyio memory stream: the core puts without
ever waiting (backpressure is the scheduler's, see stages/channel.py), and a consumer
that finds an item waiting takes it without a trip through the event loop. Taking is
still a cancellation point: a consumer whose scope is cancelled stops at its next item.

Every decoding request's consumer waits once per step, so the wait is made cheap where
the engine usually runs: on asyncio (and uvloop) it is a bare future, a quarter of the
cost of an anyio Event; on other backends it is an anyio Event.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

import anyio
import anyio.lowlevel


@dataclass(slots=True, eq=False)
class OutputQueue:
    items: deque = field(default_factory=deque)
    closed: bool = False                 # the producer put its last item
    abandoned: bool = False              # the consumer left: what it would get is dropped
    _waiter: asyncio.Future | anyio.Event | None = None   # woken when an item arrives
    _on_asyncio: bool | None = None      # the consumer's backend, known from its first wait

    def __len__(self) -> int:
        return len(self.items)

    def put(self, item: object) -> bool:
        """Queue an item for the consumer; False once it has left."""
        if self.abandoned:
            return False
        self.items.append(item)
        self._wake()
        return True

    def close(self) -> None:
        """No more items: the consumer gets what is queued, then the end of the iteration."""
        self.closed = True
        self._wake()

    def abandon(self) -> None:
        """The consumer leaves; what is queued and anything put later is dropped."""
        self.abandoned = True
        self.items.clear()

    def __aiter__(self) -> "OutputQueue":
        return self

    async def __anext__(self) -> object:
        if self.items:                   # waiting below is a cancellation point of its own
            await anyio.lowlevel.checkpoint_if_cancelled()
        while not self.items:
            if self.closed or self.abandoned:
                raise StopAsyncIteration
            if self._on_asyncio is None:
                self._on_asyncio = _in_asyncio_task()
            if self._on_asyncio:
                self._waiter = future = asyncio.get_running_loop().create_future()
                await future
            else:
                self._waiter = event = anyio.Event()
                await event.wait()
        return self.items.popleft()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if isinstance(waiter, asyncio.Future):
            if not waiter.done():        # done: its consumer was cancelled while waiting
                waiter.set_result(None)
        elif waiter is not None:
            waiter.set()


def _in_asyncio_task() -> bool:
    try:
        return asyncio.current_task() is not None
    except RuntimeError:                 # no asyncio loop in this thread: trio
        return False
