"""Turn a ScheduledBatch into the tensors one forward pass needs.

Everything is built as host arrays first, the single-token rows (decodes) as whole
columns rather than row by row, and moved to the device in one non-blocking copy per
dtype (executor.host_pack): the host never waits for the device here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from astream.core.scheduler import ScheduledBatch, ScheduledSeq
from astream.executor.decode_tables import DecodeTables
from astream.executor.host_pack import HostPack
from astream.ops.varlen import VarlenMeta


@dataclass(slots=True)
class AttentionMetadata:
    """How the tokens of one step attend. Prefill chunks come first, then single-token rows."""

    num_prefill_tokens: int
    slot_mapping: torch.Tensor                 # [T] flat cache slot of each new token
    prefill: VarlenMeta | None                 # queries: the chunk; keys: the whole context
    prefill_key_slots: torch.Tensor | None     # [Tk] cache slots of every prefill key, when
                                               # some chunk continues a cached prefix
    decode_block_tables: torch.Tensor | None   # [D, max_blocks] int32
    decode_context_lens: torch.Tensor | None   # [D] int32, including the new token
    decode_max_context: int


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor                    # [T] int64
    positions: torch.Tensor                    # [T] int64
    attn: AttentionMetadata
    sample_rows: torch.Tensor                  # [S] rows of the hidden states to sample from
    num_tokens: int
    # Rows of input_ids still unknown to the host: filled on the device from the
    # previous step's sampled ids (pending_dst <- previous_ids[pending_src]).
    pending_dst: torch.Tensor | None = None
    pending_src: torch.Tensor | None = None


def build_inputs(batch: ScheduledBatch, block_size: int, device: torch.device,
                 decode_tables: DecodeTables | None = None) -> StepInputs:
    """`decode_tables`: the caller's, kept from step to step, so unchanged tables are copied."""
    return pack_inputs(batch, block_size, decode_tables).send(device)


@dataclass(slots=True)
class HostInputs:
    """A step's inputs as host arrays, before they go to a device: plain data that pickles
    small, so tensor-parallel ranks each get it once per step and send it to their own device."""

    longs: HostPack
    ints: HostPack
    token_parts: list[int]                     # ids, positions, slots, sample rows[, pending]
    prefill: _PrefillLayout | None
    decode_parts: tuple[int, int] | None       # block tables and context lengths in `ints`
    num_prefill_tokens: int
    num_rows: int
    decode_max_context: int

    @property
    def num_sampled(self) -> int:
        return self.longs.parts[self.token_parts[3]].size

    def send(self, device: torch.device) -> StepInputs:
        sent64, sent32 = self.longs.send(device), self.ints.send(device)
        ids, positions, slots, sample_rows, *pending = (sent64[i] for i in self.token_parts)
        attn = AttentionMetadata(self.num_prefill_tokens, slots, None, None, None, None, 0)
        if self.prefill is not None:
            attn.prefill, attn.prefill_key_slots = self.prefill.meta(sent64, sent32)
        if self.decode_parts is not None:
            attn.decode_block_tables, attn.decode_context_lens = (sent32[i] for i in self.decode_parts)
            attn.decode_max_context = self.decode_max_context
        inputs = StepInputs(ids, positions, attn, sample_rows, self.num_rows)
        if pending:
            inputs.pending_dst, inputs.pending_src = pending
        return inputs


def pack_inputs(batch: ScheduledBatch, block_size: int,
                decode_tables: DecodeTables | None = None) -> HostInputs:
    split = next((i for i, item in enumerate(batch.items) if item.num_tokens == 1), len(batch.items))
    chunks, singles = batch.items[:split], batch.items[split:]
    rows = _Rows()
    for item in chunks:
        rows.add_chunk(item, block_size)
    if singles:
        tables = (DecodeTables() if decode_tables is None else decode_tables).build(
            [item.seq for item in singles])
        rows.add_singles(singles, tables, block_size)
    longs, ints = HostPack(np.int64), HostPack(np.int32)
    token_parts = [longs.add(rows.column(name)) for name in ("ids", "positions", "slots")]
    token_parts.append(longs.add(rows.sample_rows))
    if rows.pending_dst:
        token_parts += [longs.add(rows.pending_dst), longs.add(rows.pending_src)]
    prefill = _PrefillLayout.of(chunks, block_size, longs, ints) if chunks else None
    decode_parts, max_context = None, 0
    if singles:
        lens = np.fromiter((item.start + 1 for item in singles), np.int32, len(singles))
        decode_parts, max_context = (ints.add(tables), ints.add(lens)), int(lens.max())
    return HostInputs(longs, ints, token_parts, prefill, decode_parts,
                      sum(item.num_tokens for item in chunks), rows.num_rows, max_context)


@dataclass(slots=True)
class _Rows:
    """The step's token rows on the host: prefill chunks first, then single tokens."""

    ids: list = field(default_factory=list)             # arrays, one per part, concatenated later
    positions: list = field(default_factory=list)
    slots: list = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    pending_dst: list[int] = field(default_factory=list)
    pending_src: list[int] = field(default_factory=list)
    num_rows: int = 0

    def column(self, name: str) -> np.ndarray:
        parts = getattr(self, name)
        return np.concatenate(parts) if len(parts) != 1 else parts[0]

    def add_chunk(self, item: ScheduledSeq, block_size: int) -> None:
        seq, start, end = item.seq, item.start, item.start + item.num_tokens
        known_end = seq.num_tokens - seq.num_pending
        ids = seq.token_slice(start, min(end, known_end))
        for _ in range(max(start, known_end), end):        # unknown to the host: filled on the device
            self.pending_dst.append(self.num_rows + len(ids))
            self.pending_src.append(seq.pending_row)
            ids.append(0)
        positions = np.arange(start, end, dtype=np.int64)
        self.ids.append(np.array(ids, dtype=np.int64))
        self.positions.append(positions)
        self.slots.append(_cache_slots(np.array(seq.block_table, dtype=np.int64), positions, block_size))
        self.num_rows += end - start
        if item.sample:
            self.sample_rows.append(self.num_rows - 1)

    def add_singles(self, items: tuple[ScheduledSeq, ...], tables: np.ndarray, block_size: int) -> None:
        """One row per item, whole columns at a time (these are the decodes)."""
        first, n = self.num_rows, len(items)
        positions = np.fromiter((item.start for item in items), np.int64, n)
        blocks = tables[np.arange(n), positions // block_size].astype(np.int64)
        ids = []
        for row, item in enumerate(items, first):
            seq, pos = item.seq, item.start
            prompt, output = seq.prompt_token_ids, seq.output_token_ids
            if pos < len(prompt):
                ids.append(prompt[pos])
            elif pos - len(prompt) < len(output):
                ids.append(output[pos - len(prompt)])
            else:                                          # unknown to the host: filled on the device
                self.pending_dst.append(row)
                self.pending_src.append(seq.pending_row)
                ids.append(0)
            if item.sample:
                self.sample_rows.append(row)
        self.ids.append(np.array(ids, dtype=np.int64))
        self.positions.append(positions)
        self.slots.append(blocks * block_size + positions % block_size)
        self.num_rows += n


@dataclass(slots=True)
class _PrefillLayout:
    """Where the prefill chunks' queries and keys lie, on the host and in the packs."""

    cu_q: list[int]
    cu_k: list[int]
    parts: tuple[int, int]               # cu_q and cu_k in the int32 pack
    key_slots: int | None                # every key's cache slot in the int64 pack, when needed

    @classmethod
    def of(cls, chunks: tuple[ScheduledSeq, ...], block_size: int, longs: HostPack,
           ints: HostPack) -> "_PrefillLayout":
        cu_q, cu_k = [0], [0]
        for item in chunks:
            cu_q.append(cu_q[-1] + item.num_tokens)
            cu_k.append(cu_k[-1] + item.start + item.num_tokens)
        key_slots = None
        if any(item.start > 0 for item in chunks):          # some chunk continues a cached prefix
            key_slots = longs.add(np.concatenate([
                _cache_slots(np.array(item.seq.block_table, dtype=np.int64),
                             np.arange(item.start + item.num_tokens, dtype=np.int64), block_size)
                for item in chunks]))
        return cls(cu_q, cu_k, (ints.add(cu_q), ints.add(cu_k)), key_slots)

    def meta(self, sent64: list[torch.Tensor], sent32: list[torch.Tensor]
             ) -> tuple[VarlenMeta, torch.Tensor | None]:
        cu_q, cu_k = self.cu_q, self.cu_k
        meta = VarlenMeta(sent32[self.parts[0]], sent32[self.parts[1]],
                          max(b - a for a, b in zip(cu_q, cu_q[1:])),
                          max(b - a for a, b in zip(cu_k, cu_k[1:])), list(cu_q), list(cu_k))
        return meta, None if self.key_slots is None else sent64[self.key_slots]


def _cache_slots(table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Flat cache slots (block * block_size + offset) of `positions`."""
    return table[positions // block_size] * block_size + positions % block_size


def varlen_meta(cu_q: list[int], cu_k: list[int], device: torch.device) -> VarlenMeta:
    """VarlenMeta from host offsets: device copies plus the host lists the reference path uses."""
    return VarlenMeta(to_device(cu_q, torch.int32, device), to_device(cu_k, torch.int32, device),
                      max(b - a for a, b in zip(cu_q, cu_q[1:])),
                      max(b - a for a, b in zip(cu_k, cu_k[1:])), list(cu_q), list(cu_k))


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor, through pinned memory so the copy does not block."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
