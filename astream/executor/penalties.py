"""Logit processing before sampling: presence, frequency and repetition penalties, and the
EOS / stop-token mask of min_tokens.

The host sends, once per step and only for the rows that ask, the ids it knows (generated
tokens, and prompt tokens for a repetition penalty) as (row, token) pairs; the device
counts them into a [rows, vocab] table. A row's newest token may still be on its way to
the host: it is read on the device from the previous step's sampled ids, as the step's
inputs are (executor.inputs), so nothing waits for the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from astream.core.sequence import Sequence
from astream.executor.host_pack import HostPack


@dataclass(slots=True)
class Penalties:
    rows: torch.Tensor                  # [P] int64: the batch rows with a penalty
    values: torch.Tensor                # [3, P] float32: presence, frequency, repetition (1: off)
    generated: torch.Tensor             # [2, N] int64: (penalty row, token id) per known output token
    prompt: torch.Tensor | None         # [2, M] int64: (penalty row, token id) per prompt token
    pending_rows: torch.Tensor | None   # [Q] int64: penalty rows whose newest token is on the device
    pending_src: torch.Tensor | None    # [Q] int64: its row in the previous step's sampled ids

    @property
    def presence(self) -> torch.Tensor:
        return self.values[0]

    @property
    def frequency(self) -> torch.Tensor:
        return self.values[1]

    @property
    def repetition(self) -> torch.Tensor:
        return self.values[2]


@dataclass(slots=True)
class LogitsProcessing:
    """What a step does to its logits before sampling; None where no row asks."""

    penalties: Penalties | None
    banned: torch.Tensor | None         # [2, B] int64: (batch row, token id) set to -inf


def build_processing(rows: list[Sequence], vocab_size: int, device: torch.device,
                     eos_ids: frozenset[int]) -> LogitsProcessing | None:
    """From the sampled rows' params and known tokens; None when no row needs any."""
    longs, floats = HostPack(np.int64), HostPack(np.float32)
    pen_rows, values, generated, prompt, pending_rows, pending_src, banned = [], [], [], [], [], [], []
    for row, seq in enumerate(rows):
        params = seq.params
        if params.penalized:
            index = len(pen_rows)
            pen_rows.append(row)
            values.append((params.presence_penalty, params.frequency_penalty, params.repetition_penalty))
            generated.append(_pairs(index, seq.output_token_ids))
            if params.repetition_penalty != 1.0:
                prompt.append(_pairs(index, seq.prompt_token_ids))
            if seq.num_pending:
                pending_rows.append(index)
                pending_src.append(seq.pending_row)
        if params.min_tokens and seq.num_output_tokens < params.min_tokens:
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_ids)
            banned.append(_pairs(row, sorted(t for t in stops if t < vocab_size)))
    if not pen_rows and not banned:
        return None
    parts: dict[str, int] = {}
    if pen_rows:
        parts["rows"] = longs.add(pen_rows)
        parts["generated"] = longs.add(np.concatenate(generated, axis=1))
        if prompt:
            parts["prompt"] = longs.add(np.concatenate(prompt, axis=1))
        if pending_rows:
            parts["pending_rows"], parts["pending_src"] = longs.add(pending_rows), longs.add(pending_src)
        floats.add(np.array(values, dtype=np.float32).T)
    if banned:
        parts["banned"] = longs.add(np.concatenate(banned, axis=1))
    sent = longs.send(device)
    get = {name: sent[index] for name, index in parts.items()}.get
    penalties = None
    if pen_rows:
        penalties = Penalties(get("rows"), floats.send(device)[0], get("generated"),
                              get("prompt"), get("pending_rows"), get("pending_src"))
    return LogitsProcessing(penalties, get("banned"))


def process_logits(logits: torch.Tensor, processing: LogitsProcessing,
                   previous_ids: torch.Tensor | None) -> torch.Tensor:
    """logits [S, V] -> new logits with penalties applied and banned tokens at -inf."""
    if processing.penalties is not None:
        logits = apply_penalties(logits, processing.penalties, previous_ids)
    if processing.banned is not None:
        logits = logits.index_put((processing.banned[0], processing.banned[1]),
                                  # torch.full, not torch.tensor: a Python value copied to the device waits for the queue.
                                  torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device))
    return logits


def apply_penalties(logits: torch.Tensor, pen: Penalties, previous_ids: torch.Tensor | None) -> torch.Tensor:
    """Repetition first (prompt and output), then frequency and presence (output only), as
    vLLM orders them."""
    counts = torch.zeros(pen.rows.shape[0], logits.shape[1], dtype=logits.dtype, device=logits.device)
    count_output_tokens(counts, pen, previous_ids)
    seen = counts > 0
    repeated = seen
    if pen.prompt is not None:
        repeated = seen.index_put((pen.prompt[0], pen.prompt[1]),
                                  torch.ones((), dtype=torch.bool, device=logits.device))
    rows = penalize(logits.index_select(0, pen.rows), counts, seen, repeated, pen.values)
    return logits.index_copy(0, pen.rows, rows)


def count_output_tokens(counts: torch.Tensor, pen: Penalties, previous_ids: torch.Tensor | None,
                        table_rows: torch.Tensor | None = None) -> None:
    """Add each penalized row's known output tokens, and its newest one still only on the
    device (in `previous_ids`), to counts [rows, V] in place: at the row's penalty index, or
    at table_rows[index] where given (a table of the whole batch)."""
    def at(index: torch.Tensor) -> torch.Tensor:
        return index if table_rows is None else table_rows[index]

    # A full tensor, not a Python scalar: a value copied to the device waits for the queue.
    one = torch.ones((), dtype=counts.dtype, device=counts.device)
    counts.index_put_((at(pen.generated[0]), pen.generated[1]), one.expand(pen.generated.shape[1]),
                      accumulate=True)
    if pen.pending_rows is not None:
        if previous_ids is None:
            raise RuntimeError("a penalized row with a pending token needs the previous step's ids")
        counts.index_put_((at(pen.pending_rows), previous_ids[pen.pending_src]),
                          one.expand(pen.pending_rows.shape[0]), accumulate=True)


def penalize(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, repeated: torch.Tensor,
             values: torch.Tensor) -> torch.Tensor:
    """logits [R, V] with each row's penalties (`values` [3, R]: presence, frequency,
    repetition) applied: `counts` [R, V] of output tokens, `seen` its tokens, `repeated` its
    tokens and, for a repetition penalty, the prompt's. Presence 0, frequency 0 and
    repetition 1 leave a row exactly as it was."""
    presence, frequency, repetition = (v.unsqueeze(1) for v in values)
    logits = torch.where(repeated, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - frequency * counts - presence * seen.to(logits.dtype)


def _pairs(row: int, token_ids: list[int]) -> np.ndarray:
    pairs = np.empty((2, len(token_ids)), dtype=np.int64)
    pairs[0] = row
    pairs[1] = token_ids
    return pairs
