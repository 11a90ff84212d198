"""A burst of requests handled in one turn of the event loop.

Each receive and send on a channel lets the loop switch tasks, and a turn of the loop can
be a whole step long (the forward stage launches a step from it). Handled one at a time,
a burst of requests (a batch from `LLM.generate`, many clients at once) would reach the
scheduler a few per step, and each of those steps would carry a small prompt chunk, which
runs eagerly, at several times a graph step's cost. So the tokenize stage takes
everything already queued behind the item it woke for and hands it to admit as one list,
and admit takes every list waiting. String prompts cost tokenizer time, so a burst is
handed over in slices of at most TIME_SLICE_S, and the loop gets a turn between them.
"""

from __future__ import annotations

from typing import TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

T = TypeVar("T")

TIME_SLICE_S = 0.02        # about three decode steps of a small model on an H100


def with_queued(first: T, inbox: MemoryObjectReceiveStream) -> list[T]:
    """`first` and every item already waiting behind it in `inbox`."""
    items = [first]
    while True:
        try:
            items.append(inbox.receive_nowait())
        except (anyio.WouldBlock, anyio.EndOfStream):
            return items
