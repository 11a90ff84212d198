"""The sparse-attention policy seam.

A policy is a small frozen description of a method and its parameters (`FullPolicy()`,
`QuestPolicy(budget_tokens=2048)`). When an engine is built it is bound once to the
model's attention shape and the KV cache it will read (`KVLayout`): `bind` returns a
`PolicyRuntime`, which owns whatever device metadata the method keeps and which the
executor's attention adapters call, on the resident path and with offload alike:

- `on_kv_written(layer, keys, slots)`: once per layer, the keys just stored (every new
  token of the step, batched, as the cache holds them: `KVLayout.key_dtype`) and their
  flat cache slots (host pool slots with offload), if `watches_keys()`;
- `selects_decode(layer, max_context)` (host ints only) and `select_decode(layer, query)`:
  which pages each sequence's decode query reads, per KV head, as device tensors;
- `prefill_attention(layer, q, k, v, meta, causal, scale)`: may replace attention over one prefill
  part (a chunk over itself, or over a slice of its prefix) and return (out, lse).

No hook may read a device value on the host (`.item()`, `.tolist()`, synchronize): they
run once per layer inside steps, and on the resident path inside CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from astream.ops.varlen import VarlenMeta


@dataclass(slots=True, frozen=True)
class KVLayout:
    """What a policy is bound to: the model's attention shape and the cache it reads."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int                  # physical blocks of the cache (the host pool with offload)
    block_size: int
    dtype: torch.dtype               # the model's: queries and attention outputs
    device: torch.device
    offload: bool
    # What the cache stores keys as: the model's dtype, or an fp8 type holding value / scale
    # with one positive scale per (layer, KV head).
    key_dtype: torch.dtype


@dataclass(slots=True, frozen=True)
class DecodeQuery:
    """One layer's decode queries and the KV they may read (device tensors, one row a sequence)."""

    q: Tensor                        # [B, H, D]
    block_tables: Tensor             # [B, max_blocks] int32: the blocks holding that KV
    context_lens: Tensor             # [B] int32: tokens selectable (from the start of the table)
    max_context: int                 # a host bound on context_lens (fixes the shapes)
    # The executor's asks: read the block after context_lens whole too (the unfinished
    # newest block; context_lens is then a multiple of the block size), and give each
    # entry's physical page id (to gather pages from a host pool).
    append_newest: bool = False
    physical: bool = False


@dataclass(slots=True, frozen=True)
class PageSelection:
    """Per sequence and KV head, the logical pages a decode query reads."""

    indices: Tensor                  # [B, KVH, P] int32, ascending; entries past counts repeat
    counts: Tensor                   # [B, KVH] int32
    page_size: int
    physical: Tensor | None = None   # [B, KVH, P] int64 block * (block_size // page_size) + j


class PolicyRuntime:
    """A policy bound to one engine. This base is full attention: every hook is a no-op."""

    def on_kv_written(self, layer: int, keys: Tensor, slots: Tensor) -> None:
        return None

    def watches_keys(self) -> bool:
        """Whether `on_kv_written` uses the keys (host only): the executor then hands it the
        keys as stored (fp8 ones not dequantized). By default: whether the runtime
        overrides `on_kv_written`."""
        return type(self).on_kv_written is not PolicyRuntime.on_kv_written

    def selects_decode(self, layer: int, max_context: int) -> bool:
        return False

    def reuses_decode_pages(self) -> bool:
        """Whether offloaded decode keeps the selected pages on the device from step to step
        and loads only new ones (kvcache.page_reuse), host only."""
        return False

    def may_select_decode(self) -> bool:
        """Whether some layer may ever select decode pages (host only): an offloaded step then
        also packs the ring jobs of prefill rows alone."""
        return False

    def replaces_prefill(self, layer: int) -> bool:
        """Whether `prefill_attention` replaces a chunk's attention on this layer (host
        only). With offload such a layer gets each chunk's whole context at once."""
        return False

    def select_decode(self, layer: int, query: DecodeQuery) -> PageSelection:
        raise NotImplementedError("only called when selects_decode is True")

    def prefill_attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta: VarlenMeta,
                          causal: bool, scale: float) -> tuple[Tensor, Tensor] | None:
        """Attention over one prefill part (q [Tq, H, D], k/v [Tk, KVH, D] packed by `meta`;
        causal bottom-right when `causal`) as (out, lse), or None for the engine's kernel."""
        return None

    def stats(self) -> dict:
        return {}


def check_int(owner: str, key: str, value: object, low: int) -> None:
    """A policy parameter that must be an integer >= low (a bool is not one)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{owner} {key} must be an integer >= {low}, got {value!r}")


class SparsePolicy:
    """A sparse-attention method with its parameters; see the module docstring."""

    name = "base"
    phase = ""                       # "prefill" or "decode": the phase it makes sparse

    def bind(self, layout: KVLayout) -> PolicyRuntime:
        return PolicyRuntime()

    def kv_overhead(self, num_layers: int, block_size: int = 0) -> float:
        """Device bytes of metadata the policy keeps, per byte of KV in the cache of blocks
        of `block_size` tokens (0: not known; then an upper bound)."""
        return 0.0

    @property
    def sparse_prefill(self) -> bool:
        """Whether it replaces prefill attention (with offload it then reads whole prefixes)."""
        return self.phase == "prefill"

    def decode_buffer_tokens(self) -> int:
        """With offload, tokens of KV the runtime keeps on the device per decode row and
        offloaded layer besides the cache (Quest's `reuse_pages`), counted when the device
        memory is planned."""
        return 0

    def offload_device_layers(self, num_layers: int) -> tuple[int, ...]:
        """Layers whose KV stays on the device too when the cache is offloaded: those that
        read their whole context every decode step, while other layers read only what the
        policy selects (loading them through the ring would dominate such a step)."""
        return ()
