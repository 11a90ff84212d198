"""The sparse-attention policy seam.

A policy decides which KV blocks attention reads and may replace prefill attention.
Policies compute; the OffloadEngine moves data. The engine calls them at three points:

- `select_blocks(blocks, ctx)`: which host blocks a sequence's attention needs at one
  layer (only consulted when `requires_block_selection` is set).
- `on_block_offload(event)`: called once per block per layer with that block's keys,
  while they are still on the device and before the block leaves for the host
  (Quest keeps per-block key bounds here).
- `prefill_attention(q, k, v, ctx)`: an optional replacement for causal attention over
  a prefill chunk (MInference, XAttention); None means "use full attention".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class PolicyContext:
    """Everything a policy may look at for one sequence at one layer, passed as one object."""

    layer: int
    phase: str                         # "prefill" | "decode"
    request_id: str
    block_size: int
    num_context_tokens: int            # tokens before the ones computed now
    query: torch.Tensor | None = None  # [rows, heads, head_dim] when available


@dataclass(slots=True, frozen=True)
class BlockOffload:
    """One full block about to leave the device."""

    host_block: int
    layer: int
    keys: torch.Tensor                 # [block_size, kv_heads, head_dim] on the device


class SparsePolicy:
    name = "base"
    supports_prefill = True
    supports_decode = True
    requires_block_selection = False

    def select_blocks(self, blocks: list[int], ctx: PolicyContext) -> list[int]:
        return blocks

    def on_block_offload(self, event: BlockOffload) -> None:
        return None

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          ctx: PolicyContext) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None
