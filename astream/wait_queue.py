"""The scheduler's waiting sequences: one FIFO per client, picked fairly between clients."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Mapping

from astream.sequence import Sequence


@dataclass(slots=True)
class WaitQueue:
    queues: dict[str, deque] = field(default_factory=dict)     # client -> its waiting sequences
    size: int = 0

    def push(self, seq: Sequence) -> None:
        self.queues.setdefault(seq.client, deque()).append(seq)
        self.size += 1

    def push_front(self, seq: Sequence) -> None:
        """For sequences that already ran (preempted, resumed): first in their client's line."""
        self.queues.setdefault(seq.client, deque()).appendleft(seq)
        self.size += 1

    def remove(self, seq: Sequence) -> None:
        queue = self.queues[seq.client]
        queue.remove(seq)
        if not queue:
            del self.queues[seq.client]
        self.size -= 1

    def heads(self, running: Mapping[str, int]) -> list[Sequence]:
        """The first waiting sequence of each client, fairest first: fewest running
        sequences of its client, then earliest arrival."""
        return sorted((q[0] for q in self.queues.values()),
                      key=lambda seq: (running.get(seq.client, 0), seq.arrival))

    def fairest(self, running: Mapping[str, int]) -> Sequence | None:
        heads = [q[0] for q in self.queues.values()]
        return min(heads, key=lambda seq: (running.get(seq.client, 0), seq.arrival), default=None)

    def __contains__(self, seq: Sequence) -> bool:
        queue = self.queues.get(seq.client)
        return queue is not None and seq in queue

    def __len__(self) -> int:
        return self.size

    def __bool__(self) -> bool:
        return self.size > 0

    def __iter__(self) -> Iterator[Sequence]:
        for queue in self.queues.values():
            yield from queue
