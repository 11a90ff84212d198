"""A decode step's sampling with everything a row may ask, as a CUDA graph of its own: the
penalties and min_tokens bans (executor.penalties), temperature, top-k, top-p
(executor.sampler) and logprobs (executor.logprobs). It is called the tail: it replays
right after the step's greedy graph (executor.graph_sampling), which leaves the step's
float32 logits in a static table, so the model is captured once per batch size whatever
the rows ask, and each `Tail` (which parts a step needs) is a small graph per size.

Before the replay the host fills static tables from what it already sent for the step
(`SamplingBatch`, `LogitsProcessing`), with a few copies and scatters on the device and no
work per token: per-row temperature, top_k, top_p and penalty values; the output-token
counts, the prompt tokens of rows with a repetition penalty and the banned tokens as
[rows, vocab] tables, counted from the (row, token) pairs, and for a token that is only on
the device from the previous step's ids. The program is the eager sampler's own code
(`penalize`, `choose`, `compute_logprobs`) over these tables, where a row without a
penalty has presence 0, frequency 0 and repetition 1 (exactly its logits), without top-k
the vocabulary size and without top-p 1 (no cut). So a greedy row takes the eager
sampler's token, and a drawing row draws from the same distribution, with the very draws
of the eager step where the batch fills its captured size.

Logprobs: the chosen token's, and the MAX_LOGPROBS most likely alternatives of every row;
the host reads as many as each row asked for.

Rows with a request seed stay on the host: each draws from a generator seeded for its
(seed, token index) at every step, and a graph advances only the generators registered
when it was captured.

Memory: the tables are allocated with the graphs' other static buffers, and the memory
plan counts them with the workspace the tails keep in the graphs' pool ("graph_sampling",
kvcache.sizing.graph_sampling_bytes), on the ranks whose graphs have tails
(executor.build.graph_sampling_rows): under tensor parallelism rank 0's alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from astream.base.sampling import MAX_LOGPROBS
from astream.executor.logprobs import StepLogprobs, compute_logprobs
from astream.executor.penalties import LogitsProcessing, count_output_tokens, penalize
from astream.executor.sampler import SamplingBatch, choose


@dataclass(slots=True, frozen=True)
class Tail:
    """What a step's sampling does beyond a greedy argmax of its logits."""

    process: bool                       # penalties or min_tokens bans
    draw: bool                          # some rows sample at a temperature
    filter: bool                        # with top-k or top-p
    logprobs: bool


def tail_mode(batch: SamplingBatch) -> Tail | None:
    """The tail that samples `batch` as `sample` would; None where the host must (seeds)."""
    if batch.seeded_rows or (batch.num_logprobs or 0) > MAX_LOGPROBS:
        return None
    return Tail(batch.processing is not None, not batch.all_greedy,
                batch.top_k is not None or batch.top_p is not None, batch.num_logprobs is not None)


def tail_modes(draws: bool) -> list[Tail]:
    """Every tail a step may need but the greedy and temperature graphs' own sampling;
    `draws` False: only those that draw nothing (a torch whose graphs cannot advance a
    generator)."""
    picks = ((False, False), (True, False), (True, True)) if draws else ((False, False),)
    return [Tail(process, draw, cut, logprobs) for process in (False, True)
            for draw, cut in picks for logprobs in (False, True) if process or cut or logprobs]


@dataclass(slots=True)
class SamplingTables:
    """The static buffers the tails read and write, for up to `rows` rows."""

    logits: torch.Tensor                # [B, V] float32, written by the greedy graph
    counts: torch.Tensor                # [B, V] float32: each row's output tokens
    prompt: torch.Tensor                # [B, V] bool: prompt tokens (repetition penalty)
    banned: torch.Tensor                # [B, V] bool: held back until min_tokens
    top_k: torch.Tensor                 # [B] int64, the vocabulary size where off
    top_p: torch.Tensor                 # [B] float32, 1 where off
    penalties: torch.Tensor             # [3, B] float32: presence, frequency, repetition
    chosen: torch.Tensor                # [B] float32: the sampled token's logprob
    top_values: torch.Tensor            # [B, K] float32, descending
    top_ids: torch.Tensor               # [B, K] int64
    dirty: int = 0                      # rows of counts, prompt and banned a fill wrote

    @classmethod
    def allocate(cls, rows: int, vocab_size: int, device: torch.device) -> "SamplingTables":
        def table(dtype: torch.dtype, *shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        k = min(MAX_LOGPROBS, vocab_size)
        return cls(table(torch.float32, rows, vocab_size), table(torch.float32, rows, vocab_size),
                   table(torch.bool, rows, vocab_size), table(torch.bool, rows, vocab_size),
                   torch.full((rows,), vocab_size, dtype=torch.int64, device=device),
                   table(torch.float32, rows), table(torch.float32, 3, rows),
                   table(torch.float32, rows), table(torch.float32, rows, k), table(torch.int64, rows, k))

    @property
    def vocab_tables(self) -> tuple[torch.Tensor, ...]:
        """The [rows, vocab] tables (what the memory plan counts per row and token)."""
        return self.logits, self.counts, self.prompt, self.banned

    def fill(self, batch: SamplingBatch, n: int, size: int, tail: Tail,
             previous_ids: torch.Tensor | None) -> None:
        """This step's rows :n of what `tail` reads; padding rows up to `size` cut nothing."""
        if tail.filter:
            _fill_rows(self.top_k, batch.top_k, n, size, self.logits.shape[1])
            _fill_rows(self.top_p, batch.top_p, n, size, 1.0)
        if tail.process:
            self._fill_processing(batch.processing, n, size, previous_ids)

    def _fill_processing(self, processing: LogitsProcessing, n: int, size: int,
                         previous_ids: torch.Tensor | None) -> None:
        if self.dirty:
            for table in (self.counts, self.prompt, self.banned):
                table[:self.dirty].zero_()
        self.penalties[:2, :size].zero_()
        self.penalties[2, :size].fill_(1.0)
        # A full tensor, not a Python scalar: a value copied to the device waits for the queue.
        true = torch.ones((), dtype=torch.bool, device=self.counts.device)
        pen = processing.penalties
        if pen is not None:
            self.penalties.index_copy_(1, pen.rows, pen.values)
            count_output_tokens(self.counts, pen, previous_ids, table_rows=pen.rows)
            if pen.prompt is not None:
                self.prompt.index_put_((pen.rows[pen.prompt[0]], pen.prompt[1]), true)
        if processing.banned is not None:
            self.banned.index_put_((processing.banned[0], processing.banned[1]), true)
        self.dirty = n

    def program(self, size: int, tail: Tail, temperatures: torch.Tensor,
                generator: torch.Generator) -> torch.Tensor:
        """Rows :size sampled as `tail` says -> token ids [size] (what a tail graph captures)."""
        logits = processed = self.logits[:size]
        if tail.process:
            counts = self.counts[:size]
            seen = counts > 0
            processed = penalize(logits, counts, seen, seen | self.prompt[:size], self.penalties[:, :size])
            processed = processed.masked_fill(self.banned[:size], float("-inf"))
        cut = tail.filter
        ids = choose(processed, temperatures[:size], self.top_k[:size] if cut else None,
                     self.top_p[:size] if cut else None, not tail.draw, [], generator)
        if tail.logprobs:
            found = compute_logprobs(logits, ids, self.top_ids.shape[1])
            self.chosen[:size] = found.chosen
            self.top_values[:size] = found.top_values
            self.top_ids[:size] = found.top_ids
        return ids

    def logprobs(self, n: int) -> StepLogprobs:
        """Rows :n of the last tail's logprobs, copied out of the buffers the next step writes."""
        return StepLogprobs(self.chosen[:n].clone(), self.top_values[:n].clone(), self.top_ids[:n].clone())


def _fill_rows(table: torch.Tensor, values: torch.Tensor | None, n: int, size: int, default) -> None:
    if values is None:
        table[:size].fill_(default)
        return
    table[:n].copy_(values)
    table[n:size].fill_(default)
