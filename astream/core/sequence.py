"""One completion of a request as the scheduler, the block manager and the executor see it:
its tokens, where their KV lives and its scheduling state. Its request's record
(core.request) owns it; this view holds no text, no finish reason and no output."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from astream.base.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One request's tokens and where their KV lives.

    `num_pending` counts sampled tokens whose ids are still on their way to the
    host: the device already knows them, so the next step can be scheduled
    before the host does (see executor.inputs).
    """

    request_id: str
    prompt_token_ids: list[int]                     # the request's own list, shared by its choices
    params: SamplingParams
    arrival: int                                    # admission order: ties between clients
    client: str = ""                                # fairness group (a connection, a user)
    index: int = 0                                  # which of its request's n completions
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0                    # tokens whose KV is written or scheduled
    num_hashed_blocks: int = 0                      # leading blocks already published to the cache
    num_pending: int = 0
    kv_epoch: int = 0                               # this life of block_table (BlockManager)
    paused: bool = False                            # its consumer fell behind (backpressure)
    faults: int = 0                                 # failed steps it took part in
    slot: int = -1                                  # its running slot (Scheduler): with offload,
                                                    # the device tail block it owns
    # The row the pending token occupies in its step's sampled-ids tensor.
    pending_row: int = -1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens the sequence holds, including sampled ones the host has not seen yet."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.num_pending

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_slice(self, start: int, end: int) -> list[int]:
        """Known token ids in [start, end) without building the whole list."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len:end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - prompt_len]
