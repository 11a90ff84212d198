"""Admission, continuous batching and fairness. Pure Python: no torch, no device.

Each step, every running sequence advances first (a decode is one token, an
unfinished prompt gets its next chunk), then waiting sequences are admitted
while the token budget, the sequence limit and the free KV blocks allow. When a
running sequence needs a block and none is free, the most recently admitted
sequence is preempted: its blocks are released and it is recomputed later.

Fairness between clients (a client is whatever the caller names: a connection, a
user): the next sequence admitted belongs to the client with the fewest running
sequences, and when every running slot is taken, a client running two or more
sequences more than the waiting one gives up its newest. A paused sequence (its
consumer stopped reading) gives up its slot and blocks to anyone waiting, and is
parked until it is resumed.

Short prompts first: a waiting sequence of at most `short_prompt_tokens` tokens is
admitted before any longer one of a client with as many running (fairness between
clients comes first), and while one waits (with a running slot free for it), the chunks
of unfinished long prompts shrink to a quarter of the step's token budget (and leave the
short ones up to half of it). A step's time grows with its tokens, so the step that
admits a chat turn arriving while long prompts prefill is a short one: its first token
comes after the step already running and one quick step, and long prefill still advances
every step (the earliest long prompts first, as always).

Running slots: a sequence that starts running takes the lowest free slot number below
max_num_seqs (`seq.slot`) and gives it back when it stops (preempted or finished). With
KV offload the slot names the sequence's device tail block; the scheduler is its one owner.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from dataclasses import dataclass, field

from astream.base.errors import PromptTooLongError
from astream.core.sequence import Sequence, SequenceStatus
from astream.core.wait_queue import WaitQueue
from astream.kvcache.block_manager import BlockManager


# While a short prompt waits, unfinished long prompts' chunks take at most 1/SHORT_STEP_SHARE
# of the step's token budget, so the step that admits it ends quickly.
SHORT_STEP_SHARE = 4


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    align_chunks_to: int = 1       # unfinished prefill chunks end on multiples of this
    prefer_chunks_of: int = 1      # ...and on multiples of this where the budget allows
    short_prompt_tokens: int = 0   # waiting sequences this short go first (0: none)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at "
                             f"least max_num_seqs ({self.max_num_seqs}) so every running "
                             "sequence can decode each step")


@dataclass(slots=True, frozen=True)
class ScheduledSeq:
    seq: Sequence
    start: int          # position of the first token computed this step
    num_tokens: int     # tokens computed this step
    sample: bool        # the chunk reaches the sequence's last token: sample the next one


@dataclass(slots=True, frozen=True)
class ScheduledBatch:
    step: int
    items: tuple[ScheduledSeq, ...]      # chunks of more than one token first, then single tokens
    admitted: tuple[Sequence, ...] = ()  # sequences this step starts running (or runs again)

    @property
    def num_tokens(self) -> int:
        return sum(item.num_tokens for item in self.items)

    @property
    def prefill_tokens(self) -> int:
        """Tokens of the prompt chunks of more than one token (a decode computes one)."""
        return sum(item.num_tokens for item in self.items if item.num_tokens > 1)


@dataclass(slots=True)
class Scheduler:
    config: SchedulerConfig
    blocks: BlockManager
    waiting: WaitQueue = field(default_factory=WaitQueue)
    running: list[Sequence] = field(default_factory=list)
    parked: list[Sequence] = field(default_factory=list)       # paused, holding no blocks
    isolated: deque = field(default_factory=deque)             # from failed steps: run alone
    free_slots: list[int] = field(default_factory=list)        # running slots, a heap
    steps: int = 0
    preemptions: int = 0

    def __post_init__(self) -> None:
        self.waiting.short_tokens = self.config.short_prompt_tokens
        self.free_slots = list(range(self.config.max_num_seqs))

    def add(self, seq: Sequence) -> None:
        self.check_prompt_length(seq.num_tokens)
        self.waiting.push(seq)

    def check_prompt_length(self, num_tokens: int) -> None:
        if num_tokens >= self.config.max_model_len:
            raise PromptTooLongError(f"prompt has {num_tokens} tokens but max_model_len is "
                                     f"{self.config.max_model_len} (prompt plus at least one new "
                                     "token must fit)")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.isolated)

    def finish(self, seq: Sequence) -> None:
        """End seq (stopped, length, aborted or failed) and return its blocks. Why it ended is
        its request's record (core.request), not the scheduler's."""
        if seq.status is SequenceStatus.FINISHED:
            return
        self._unlink(seq)
        self.blocks.release(seq)
        seq.status = SequenceStatus.FINISHED

    # ---- backpressure: consumers that stop reading -----------------------------------------

    def pause(self, seq: Sequence) -> None:
        """Stop scheduling seq until `resume`; it keeps its blocks until someone needs them."""
        if seq.paused or seq.is_finished:
            return
        seq.paused = True
        if seq in self.waiting:
            self.waiting.remove(seq)
            self.parked.append(seq)

    def resume(self, seq: Sequence) -> None:
        if not seq.paused or seq.is_finished:
            return
        seq.paused = False
        if seq in self.parked:
            self.parked.remove(seq)
            self.waiting.push_front(seq)

    def paused(self) -> list[Sequence]:
        return [s for s in self.running if s.paused] + self.parked

    # ---- sampled tokens in flight ----------------------------------------------------------

    def launched(self, sampled: list[Sequence]) -> None:
        """A step that samples one token for each of `sampled` (in row order) was prepared."""
        for row, seq in enumerate(sampled):
            seq.num_pending += 1
            seq.pending_row = row

    def dropped(self, sampled: list[Sequence]) -> None:
        """That step failed: its tokens never come."""
        for seq in sampled:
            seq.num_pending -= 1

    def token_arrived(self, seq: Sequence, token_id: int) -> bool:
        """A sampled id reached the host. False if seq ended while it was in flight."""
        seq.num_pending -= 1
        if seq.is_finished:
            return False
        seq.output_token_ids.append(token_id)
        return True

    # ---- failures ---------------------------------------------------------------------------

    def record_fault(self, seq: Sequence) -> int:
        """Count a failed step seq took part in; returns how many it has."""
        seq.faults += 1
        return seq.faults

    def isolate(self, seq: Sequence) -> None:
        """Recompute seq in a step of its own, so a repeated failure is pinned on it."""
        self.preempt(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
            self.isolated.append(seq)

    # ---- steps ----------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        if self.isolated:
            batch = self._schedule_isolated()
            if batch is not None:
                return batch
        self._rebalance()
        budget = self.config.max_num_batched_tokens
        reserve = self._short_reserve(budget)
        # At least one aligned chunk (offload cuts chunks on block boundaries): a quarter of a
        # small budget could be less, and the long prompts would never advance.
        long_budget = max(budget // SHORT_STEP_SHARE, self.config.align_chunks_to) if reserve else budget
        items: list[ScheduledSeq] = []
        preempted = False
        running, block_size = self.running, self.blocks.block_size
        index = 0
        while index < len(running) and budget > 0:
            seq = running[index]
            index += 1
            prefilling = seq.num_tokens - seq.num_computed_tokens > 1
            n = self._chunk(seq, min(budget - reserve, long_budget) if prefilling else budget)
            if n <= 0 or seq.paused:
                continue
            if prefilling:
                long_budget -= n
            # Most steps of a decode fit in the blocks it holds: no allocation, no preemption.
            if seq.num_computed_tokens + n > len(seq.block_table) * block_size \
                    and not self._make_room(seq, n):
                preempted = True
                break                      # seq itself was preempted; it was the last one
            items.append(self._take(seq, n))
            budget -= n
        running_items = len(items)
        if not preempted and self.waiting:
            self._admit(budget, items, long_budget)
        if not items:
            return None
        self.steps += 1
        admitted = tuple(item.seq for item in items[running_items:])
        items = [i for i in items if i.num_tokens != 1] + [i for i in items if i.num_tokens == 1]
        return ScheduledBatch(self.steps, tuple(items), admitted)

    def _short_reserve(self, budget: int) -> int:
        """Tokens this step keeps from long prefill chunks for short prompts that wait."""
        if len(self.running) >= self.config.max_num_seqs:
            return 0
        waiting = sum(seq.num_tokens for seq in self.waiting.short_heads() if not seq.num_pending)
        return min(waiting, budget // 2)

    def _schedule_isolated(self) -> ScheduledBatch | None:
        """A sequence from a failed step runs alone, so a repeat failure is its own."""
        seq = self.isolated[0]
        if seq.num_pending or len(self.running) >= self.config.max_num_seqs:
            return None
        item = self._try_admit(seq, self.config.max_num_batched_tokens)
        if item is None:
            return None
        self.isolated.popleft()
        self.steps += 1
        return ScheduledBatch(self.steps, (item,), (seq,))

    def _rebalance(self) -> None:
        """Free running slots for waiting clients: paused sequences first, then the newest
        sequence of a client running at least two more than the waiting one."""
        if len(self.running) < self.config.max_num_seqs or not self.waiting:
            return
        counts = Counter(s.client for s in self.running)
        for candidate in self.waiting.heads(counts):
            victim = self._slot_victim(counts, counts[candidate.client])
            if victim is None:
                return
            counts[victim.client] -= 1
            counts[candidate.client] += 1          # it is next in line for the freed slot
            self.preempt(victim)

    def _slot_victim(self, counts: Counter, candidate_count: int) -> Sequence | None:
        for seq in reversed(self.running):
            if seq.paused:
                return seq
        richest = max(counts, key=lambda client: counts[client])
        if counts[richest] < candidate_count + 2:
            return None
        return next(s for s in reversed(self.running) if s.client == richest)

    def _make_room(self, seq: Sequence, n: int) -> bool:
        target = seq.num_computed_tokens + n
        while not self.blocks.can_grow(seq, target):
            victim = next((s for s in reversed(self.running) if s.paused), self.running[-1])
            self.preempt(victim)
            if victim is seq:
                return False
        self.blocks.grow(seq, target)
        return True

    def _admit(self, budget: int, items: list[ScheduledSeq], long_budget: int) -> None:
        """Admit waiting sequences while budget, slots and blocks allow; prompts longer than
        short ones take their chunks from long_budget too."""
        counts = Counter(s.client for s in self.running)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.fairest(counts)
            long = not self.waiting.is_short(seq)
            if long and long_budget <= 0:
                # Long prompts have had their share of this step; a short one behind them
                # (in fairness order) still may start.
                seq, long = self.waiting.fairest(counts, short_only=True), False
                if seq is None:
                    break
            if seq.num_pending:
                break         # a sampled id still in flight: it can be admitted next step
            item = self._try_admit(seq, min(budget, long_budget) if long else budget,
                                   reserve=self._watermark())
            if item is None and long:
                # The long one gets no chunk or no blocks this step; a short one may still.
                short = self.waiting.fairest(counts, short_only=True)
                if short is not None and not short.num_pending:
                    seq, long = short, False
                    item = self._try_admit(seq, budget, reserve=self._watermark())
            if item is None:
                break
            self.waiting.remove(seq)
            counts[seq.client] += 1
            items.append(item)
            budget -= item.num_tokens
            if long:
                long_budget -= item.num_tokens

    def _watermark(self) -> int:
        return max(1, self.blocks.num_blocks // 100) if self.running else 0

    def _try_admit(self, seq: Sequence, budget: int, reserve: int = 0) -> ScheduledSeq | None:
        """Give seq its blocks and its first chunk, or leave everything as it was."""
        self.blocks.reuse_cached_prefix(seq)
        n = self._chunk(seq, budget)
        target = seq.num_computed_tokens + n
        need = self.blocks.blocks_needed(target) - len(seq.block_table)
        if n > 0 and need > self.blocks.num_free - reserve:
            self._park_paused_for(need + reserve)
        if n <= 0 or need > self.blocks.num_free - reserve:
            self.blocks.release(seq)
            return None
        self.blocks.grow(seq, target)
        seq.status, seq.slot = SequenceStatus.RUNNING, heapq.heappop(self.free_slots)
        self.running.append(seq)
        return self._take(seq, n)

    def _park_paused_for(self, blocks: int) -> None:
        for victim in [s for s in reversed(self.running) if s.paused]:
            if self.blocks.num_free >= blocks:
                return
            self.preempt(victim)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens seq computes this step: all it has left, or an aligned part of it."""
        if seq.num_output_tokens >= seq.params.max_tokens:
            return 0        # its last token is sampled (maybe still in flight): nothing to compute
        start, left = seq.num_computed_tokens, seq.num_tokens - seq.num_computed_tokens
        if left <= budget:
            return left
        for align in (self.config.prefer_chunks_of, self.config.align_chunks_to):
            n = (start + budget) // align * align - start
            if n > 0:
                return n
        return 0

    def _take(self, seq: Sequence, n: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        seq.num_computed_tokens += n
        return ScheduledSeq(seq, start, n, sample=seq.num_computed_tokens == seq.num_tokens)

    def preempt(self, seq: Sequence) -> None:
        """Release seq's blocks; it is recomputed later (once resumed, if it is paused)."""
        if seq.status is not SequenceStatus.RUNNING:
            return
        self._stop_running(seq)
        self.blocks.release(seq)
        seq.status = SequenceStatus.WAITING
        self.preemptions += 1
        if seq.paused:
            self.parked.append(seq)
        else:
            self.waiting.push_front(seq)

    def _stop_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        heapq.heappush(self.free_slots, seq.slot)
        seq.slot = -1

    def _unlink(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self._stop_running(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.parked:
            self.parked.remove(seq)
        elif seq in self.isolated:
            self.isolated.remove(seq)
