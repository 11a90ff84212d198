"""Admission and continuous batching. Pure Python: no torch, no device.

Each step, every running sequence advances first (a decode is one token, an
unfinished prompt gets its next chunk), then waiting sequences are admitted
while the token budget, the sequence limit and the free KV blocks allow. When a
running sequence needs a block and none is free, the most recently admitted
sequence is preempted: its blocks are released and it is recomputed later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from astream.kvcache.block_manager import BlockManager
from astream.sequence import Sequence, SequenceStatus


class PromptTooLongError(ValueError):
    """The prompt leaves no room for a new token within max_model_len."""


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    align_chunks_to: int = 1       # unfinished prefill chunks end on multiples of this

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at "
                             f"least max_num_seqs ({self.max_num_seqs}) so every running "
                             "sequence can decode each step")


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int          # position of the first token computed this step
    num_tokens: int     # tokens computed this step
    sample: bool        # the chunk reaches the sequence's last token: sample the next one


@dataclass(slots=True)
class ScheduledBatch:
    step: int
    items: list[ScheduledSeq]            # chunks of more than one token first, then single tokens
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(item.num_tokens for item in self.items)


@dataclass(slots=True)
class Scheduler:
    config: SchedulerConfig
    blocks: BlockManager
    waiting: deque = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)
    steps: int = 0
    preemptions: int = 0

    def add(self, seq: Sequence) -> None:
        self.check_prompt_length(seq.num_tokens)
        self.waiting.append(seq)

    def check_prompt_length(self, num_tokens: int) -> None:
        if num_tokens >= self.config.max_model_len:
            raise PromptTooLongError(f"prompt has {num_tokens} tokens but max_model_len is "
                             f"{self.config.max_model_len} (prompt plus at least one new token "
                             "must fit)")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End seq (stopped, length, aborted or failed) and return its blocks."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.blocks.release(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def schedule(self) -> ScheduledBatch | None:
        if self.waiting and self.waiting[0].isolate:
            batch = self._schedule_isolated()
            if batch is not None:
                return batch
        budget = self.config.max_num_batched_tokens
        items: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            n = self._chunk(seq, budget)
            if n <= 0 or seq.paused:
                index += 1
                continue
            if not self._make_room(seq, n, preempted):
                break                      # seq itself was preempted; it was the last one
            items.append(self._take(seq, n))
            budget -= n
            index += 1
        if not preempted:
            budget = self._admit(budget, items)
        if not items:
            return None
        self.steps += 1
        items.sort(key=lambda item: item.num_tokens == 1)
        return ScheduledBatch(self.steps, items, preempted)

    def _schedule_isolated(self) -> ScheduledBatch | None:
        """A sequence from a failed step runs alone, so a repeat failure is its own."""
        items: list[ScheduledSeq] = []
        self._admit(self.config.max_num_batched_tokens, items, isolated=True)
        if not items:
            return None
        items[0].seq.isolate = False
        self.steps += 1
        return ScheduledBatch(self.steps, items)

    def _make_room(self, seq: Sequence, n: int, preempted: list[Sequence]) -> bool:
        target = seq.num_computed_tokens + n
        while not self.blocks.can_grow(seq, target):
            victim = self.running[-1]
            self.preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        self.blocks.grow(seq, target)
        return True

    def _admit(self, budget: int, items: list[ScheduledSeq], isolated: bool = False) -> int:
        watermark = max(1, self.blocks.num_blocks // 100)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending or seq.isolate != isolated or (isolated and items):
                break         # a sampled id still in flight, or a sequence that must run alone
            self.blocks.reuse_cached_prefix(seq)
            n = self._chunk(seq, budget)
            if n <= 0:
                self.blocks.release(seq)
                break
            target = seq.num_computed_tokens + n
            need = self.blocks.blocks_needed(target) - len(seq.block_table)
            if need > self.blocks.num_free - (watermark if self.running else 0):
                self.blocks.release(seq)
                break
            self.blocks.grow(seq, target)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            items.append(self._take(seq, n))
            budget -= n
        return budget

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens seq computes this step: all it has left, or an aligned part of it."""
        if seq.num_output_tokens >= seq.params.max_tokens:
            return 0        # its last token is sampled (maybe still in flight): nothing to compute
        start, left = seq.num_computed_tokens, seq.num_tokens - seq.num_computed_tokens
        if left <= budget:
            return left
        align = self.config.align_chunks_to
        return (start + budget) // align * align - start

    def _take(self, seq: Sequence, n: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        seq.num_computed_tokens += n
        return ScheduledSeq(seq, start, n, sample=seq.num_computed_tokens == seq.num_tokens)

    def preempt(self, seq: Sequence) -> None:
        """Release seq's blocks and send it back to the front of the queue for recompute."""
        if seq.status is not SequenceStatus.RUNNING:
            return
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)
