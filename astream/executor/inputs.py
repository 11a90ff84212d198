"""Turn a ScheduledBatch into the tensors one forward pass needs.

Everything is built as host lists first and moved to the device in one
non-blocking copy per tensor: the host never waits for the device here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from astream.ops.varlen import VarlenMeta
from astream.scheduler import ScheduledBatch


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


def build_inputs(batch: ScheduledBatch, block_size: int, device: torch.device) -> StepInputs:
    ids, positions, slots, sample_rows = [], [], [], []
    pending_dst, pending_src = [], []
    for item in batch.items:
        seq, start, end = item.seq, item.start, item.start + item.num_tokens
        known_end = seq.num_tokens - seq.num_pending
        ids += seq.token_slice(start, min(end, known_end))
        for row in range(max(start, known_end), end):
            pending_dst.append(len(ids))
            pending_src.append(seq.pending_row)
            ids.append(0)
        positions += range(start, end)
        slots += _cache_slots(seq.block_table, start, end, block_size)
        if item.sample:
            sample_rows.append(len(ids) - 1)
    attn = _attention_metadata(batch, block_size, slots, device)
    inputs = StepInputs(
        input_ids=to_device(ids, torch.int64, device), positions=to_device(positions, torch.int64, device),
        attn=attn, sample_rows=to_device(sample_rows, torch.int64, device), num_tokens=len(ids))
    if pending_dst:
        inputs.pending_dst = to_device(pending_dst, torch.int64, device)
        inputs.pending_src = to_device(pending_src, torch.int64, device)
    return inputs


def _attention_metadata(batch: ScheduledBatch, block_size: int, slots: list[int],
                        device: torch.device) -> AttentionMetadata:
    prefill = [item for item in batch.items if item.num_tokens > 1]
    decode = batch.items[len(prefill):]
    num_prefill = sum(item.num_tokens for item in prefill)
    meta = AttentionMetadata(num_prefill, to_device(slots, torch.int64, device), None, None, None, None, 0)
    if prefill:
        cu_q, cu_k = [0], [0]
        for item in prefill:
            cu_q.append(cu_q[-1] + item.num_tokens)
            cu_k.append(cu_k[-1] + item.start + item.num_tokens)
        meta.prefill = varlen_meta(cu_q, cu_k, device)
        if any(item.start > 0 for item in prefill):
            key_slots = []
            for item in prefill:
                key_slots += _cache_slots(item.seq.block_table, 0, item.start + item.num_tokens,
                                          block_size)
            meta.prefill_key_slots = to_device(key_slots, torch.int64, device)
    if decode:
        width = max(len(item.seq.block_table) for item in decode)
        tables = [item.seq.block_table + [0] * (width - len(item.seq.block_table)) for item in decode]
        lens = [item.start + 1 for item in decode]
        meta.decode_block_tables = to_device(tables, torch.int32, device)
        meta.decode_context_lens = to_device(lens, torch.int32, device)
        meta.decode_max_context = max(lens)
    return meta


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


def _cache_slots(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat cache slots (block * block_size + offset) of positions [start, end)."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
