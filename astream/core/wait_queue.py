"""The scheduler's waiting sequences: one FIFO per client and kind, picked fairly.

Between clients, the one with the fewest running sequences goes first, so no client can
starve another. Among equals, a short sequence (its tokens fit `short_tokens`: a chat
turn, a classification) goes ahead of long ones, in any client's line, so a few long
prompts cannot hold back a short request's first token for the whole of their prefill;
then the earliest arrival.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Mapping

from astream.core.sequence import Sequence

Line = tuple[str, bool]                    # (client, short)


@dataclass(slots=True)
class WaitQueue:
    short_tokens: int = 0                  # 0: no sequence is short
    queues: dict[Line, deque] = field(default_factory=dict)
    lines: dict[int, Line] = field(default_factory=dict)      # id(seq) -> the line it waits in
    size: int = 0

    def push(self, seq: Sequence) -> None:
        self.queues.setdefault(self._line(seq), deque()).append(seq)
        self.size += 1

    def push_front(self, seq: Sequence) -> None:
        """For sequences that already ran (preempted, resumed): first in their client's line."""
        self.queues.setdefault(self._line(seq), deque()).appendleft(seq)
        self.size += 1

    def remove(self, seq: Sequence) -> None:
        line = self.lines.pop(id(seq))
        queue = self.queues[line]
        queue.remove(seq)
        if not queue:
            del self.queues[line]
        self.size -= 1

    def heads(self, running: Mapping[str, int]) -> list[Sequence]:
        """The first waiting sequence of each line, in the order they would be admitted."""
        return sorted((q[0] for q in self.queues.values()), key=self._order(running))

    def fairest(self, running: Mapping[str, int], short_only: bool = False) -> Sequence | None:
        """The next sequence to admit; with short_only, the next short one."""
        return min((q[0] for (_, short), q in self.queues.items() if short or not short_only),
                   key=self._order(running), default=None)

    def is_short(self, seq: Sequence) -> bool:
        return self.lines[id(seq)][1]

    def short_heads(self) -> list[Sequence]:
        return [q[0] for (_, short), q in self.queues.items() if short]

    def _line(self, seq: Sequence) -> Line:
        # Fixed when it starts waiting: its token count may grow while it waits (a sampled
        # id still in flight), and it must leave from the line it entered.
        line = self.lines[id(seq)] = (seq.client, seq.num_tokens <= self.short_tokens)
        return line

    def _order(self, running: Mapping[str, int]):
        lines = self.lines
        return lambda seq: (running.get(seq.client, 0), not lines[id(seq)][1], seq.arrival)

    def __contains__(self, seq: Sequence) -> bool:
        line = self.lines.get(id(seq))
        return line is not None and seq in self.queues[line]

    def __len__(self) -> int:
        return self.size

    def __bool__(self) -> bool:
        return self.size > 0

    def __iter__(self) -> Iterator[Sequence]:
        for queue in self.queues.values():
            yield from queue
