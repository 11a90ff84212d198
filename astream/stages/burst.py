"""A burst of requests handled in one turn of the event loop.

Each receive and send on a channel lets the loop switch tasks, and a turn of the loop can
be a whole step long (the forward stage launches a step from it). Handled one at a time,
a burst of requests (a batch from `LLM.generate`, many clients at once) would reach the
scheduler a few per step, and each of those steps would carry a small prompt chunk, which
runs eagerly, at several times a graph step's cost. So the tokenize and admit stages take
everything already queued behind the item they woke for, and pass it on without yielding
while the next channel has room.
"""

from __future__ import annotations

from typing import TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

T = TypeVar("T")


def with_queued(first: T, inbox: MemoryObjectReceiveStream) -> list[T]:
    """`first` and every item already waiting behind it in `inbox`."""
    items = [first]
    while True:
        try:
            items.append(inbox.receive_nowait())
        except (anyio.WouldBlock, anyio.EndOfStream):
            return items


async def send(outbox: MemoryObjectSendStream, item) -> None:
    """Send without yielding to the loop while the channel has room."""
    try:
        outbox.send_nowait(item)
    except anyio.WouldBlock:
        await outbox.send(item)
