"""The sparse-attention policy seam: all a policy author reads (policies/window.py is a
complete policy in one file).

Ten concepts:

1. `SparsePolicy`: a small frozen description of a method and its parameters
   (`QuestPolicy(budget_tokens=2048)`), with its `name` and the `phase` it makes sparse.
   Before the cache is sized, the engine asks it for memory: `kv_overhead`,
   `decode_buffer_tokens`, `decode_scratch_bytes`, `offload_device_layers`; and for the
   prefill chunk its estimate wants, `prefill_chunk_tokens`.
2. `KVLayout`: what the policy is bound to once, when an engine is built: the model's
   attention shape and the KV cache it reads (the host pool with offload).
3. `PolicyRuntime`: what `bind(layout)` returns. It owns the method's device metadata and
   has two halves, as a KV connector splits scheduler side from worker side: a host half
   the executor calls once per step (`plan_step`), and a device half it calls once per
   layer inside the step, and inside its CUDA graph (`on_kv_written`, `select_decode`,
   `load_pages`, `prefill_attention`). No hook may read a device value on the host
   (`.item()`, `.tolist()`, a synchronize); every hook a runtime does not override is
   Full's.
4. `PolicyTraits`: what the runtime does, declared once as data at bind (`traits`). The
   executor reads it when it is built and lays the step out by it; it never asks again.
5. `plan_step(StepShape) -> StepPlan` (host half, host ints only): which layers'
   decode rows read selected pages this step, and whether those pages go through the
   runtime's own buffers. By default both follow from the traits.
6. `on_kv_written(layer, keys, slots)`: the keys just stored in one layer, every new token
   of the step batched, as the cache holds them (`KVLayout.key_dtype`), and their flat
   cache slots (host pool slots with offload). Called only if `traits.watches_keys`.
7. `select_decode(layer, DecodeQuery) -> PageSelection`: per sequence and KV head, the
   pages a decode query reads. Called on the layers `plan_step` chose.
8. `load_pages(layer, PageSelection, HostPages, owners)`: with offload, how the chosen
   pages reach the device. Called only if `traits.loads_pages`; returning None (or not
   overriding it) lets the engine read them from the host pool itself. With
   `traits.prefetches`, `prefetch_pages(layer, DecodeQuery, HostPages, owners)` is called
   too, during the layer before, with a query predicted from that layer's residual stream
   and on a stream of its own: it may start loading what `load_pages` will then find.
   Where it returns `PrefetchedPages`, the layer reads those pages instead of selecting
   and loading its own.
9. `prefill_attention(layer, q, k, v, meta, causal, scale)`: attention over one prefill
   part (a chunk over itself, or over a slice of its prefix) as (out, lse), on the layers
   `traits.prefill_layers` names; None there is the engine's kernel.
10. `stats()`: what the method did, merged into the engine's `stats()` (it may read device
    counters: it is called outside steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from astream.ops.varlen import VarlenMeta

NO_LAYERS: frozenset[int] = frozenset()


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
    max_num_seqs: int                # decode rows one step may hold (buffers kept per row)


@dataclass(slots=True, frozen=True)
class PolicyTraits:
    """What a bound runtime does, declared once; the executor lays every step out by it."""

    watches_keys: bool = False                     # call on_kv_written with each layer's new keys
    decode_layers: frozenset[int] = NO_LAYERS      # layers whose decode may read selected pages
    select_above: int = 0            # ... once a step's longest decode context exceeds this (tokens)
    loads_pages: bool = False                      # with offload, call load_pages for the pages
    prefetches: bool = False                       # ... and prefetch_pages a layer ahead
    prefill_layers: frozenset[int] = NO_LAYERS     # layers whose prefill attention it replaces
    # With offload, layers whose KV stays on the device too: `offload_device_layers`, which
    # sized the memory before bind (the engine raises ValueError where they differ).
    device_layers: frozenset[int] = NO_LAYERS


@dataclass(slots=True, frozen=True)
class StepShape:
    """What the host knows of a step before it runs."""

    decode_rows: int
    max_context: int                 # a bound on the tokens a decode row may select from


@dataclass(slots=True, frozen=True)
class StepPlan:
    """What one step needs from the policy, the same for every layer."""

    select_layers: frozenset[int] = NO_LAYERS      # layers whose decode rows call select_decode
    load_pages: bool = False                       # those pages go through load_pages


@dataclass(slots=True, frozen=True)
class DecodeQuery:
    """One layer's decode queries and the KV they may read (device tensors, one row a sequence)."""

    q: Tensor                        # [B, H, D]
    block_tables: Tensor             # [B, max_blocks] int32: the blocks holding that KV
    context_lens: Tensor             # [B] int32: tokens selectable (from the start of the table)
    max_context: int                 # a host bound on context_lens (fixes the shapes)
    # The executor's asks: read the block after context_lens whole too (the unfinished
    # newest block; context_lens is then a multiple of the block size), and give each
    # entry's physical page id (to gather pages from a host pool: ops.pages.physical_pages).
    append_newest: bool = False
    physical: bool = False


@dataclass(slots=True, frozen=True)
class PageSelection:
    """Per sequence and KV head, the logical pages a decode query reads."""

    indices: Tensor                  # [B, KVH, P] int32, ascending; entries past counts repeat
    counts: Tensor                   # [B, KVH] int32
    page_size: int
    physical: Tensor | None = None   # [B, KVH, P] int64 block * (block_size // page_size) + j


@dataclass(slots=True, frozen=True)
class PrefetchedPages:
    """Pages a prefetch chose and loaded for a layer to read in place of its own selection."""

    chosen: PageSelection
    k: Tensor | None                 # [B, KVH, >= P * page_size, D]; None: not loaded
    v: Tensor | None
    slots: Tensor | None = None      # [B, KVH, P] int32: the page slot page p sits in; None: p


class HostPages(Protocol):
    """The host pool's page reader that `load_pages` gets (kvcache.OffloadEngine)."""

    def gather_pages(self, layer: int, page_ids: Tensor, counts: Tensor, page_size: int,
                     into: tuple[Tensor, Tensor] | None = None,
                     dst_pages: Tensor | None = None,
                     background: bool = False) -> tuple[Tensor, Tensor]:
        """The pages (physical ids [B, KVH, P], the first counts [B, KVH] of each row real)
        of one layer's host KV as k, v [B, KVH, P * page_size, head_dim], new buffers or
        `into`; with dst_pages [B, KVH, P], entry p fills page dst_pages[b, h, p] of `into`
        (-1: not read). `background`: a load beside compute (a prefetch), on a stream of its
        own after what the current stream queued, which leaves most of the GPU to the layer
        computing meanwhile."""


@dataclass(slots=True)
class PolicyRuntime:
    """A policy bound to one engine. This base is full attention: nothing to declare, and
    every hook is a no-op. A subclass is a slots dataclass too, given its traits by name."""

    traits: PolicyTraits = field(default=PolicyTraits(), kw_only=True)

    def plan_step(self, shape: StepShape) -> StepPlan:
        """Host half, once per step (host ints only)."""
        traits = self.traits
        if not shape.decode_rows or shape.max_context <= traits.select_above:
            return FULL_STEP
        return StepPlan(traits.decode_layers, traits.loads_pages)

    def on_kv_written(self, layer: int, keys: Tensor, slots: Tensor) -> None:
        return None

    def select_decode(self, layer: int, query: DecodeQuery) -> PageSelection:
        raise NotImplementedError("only called on the layers plan_step selects")

    def load_pages(self, layer: int, chosen: PageSelection, pool: HostPages,
                   owners: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
        """(k, v [B, KVH, W * page_size, D], the page of those buffers each chosen page
        sits in [B, KVH, P] int32), or None for the engine's gather. owners [B] int64: each
        row's sequence's `kv_epoch` (renewed whenever the sequence's blocks start over)."""
        return None

    def prefetch_pages(self, layer: int, query: DecodeQuery, pool: HostPages,
                       owners: Tensor) -> PrefetchedPages | None:
        """With offload, before layer `layer`'s own queries exist: query.q is a prediction
        of them. Start loading the pages it names where `load_pages` will look for them.
        Runs on the engine's prefetch stream (its `background` gathers on a load stream of
        their own), ordered before that layer's `load_pages`.
        Returns None, or the pages the layer is to read in place of its own selection (k
        and v None: the engine gathers them when the layer runs)."""
        return None

    def prefill_attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta: VarlenMeta,
                          causal: bool, scale: float) -> tuple[Tensor, Tensor] | None:
        """Attention over one prefill part (q [Tq, H, D], k/v [Tk, KVH, D] packed by `meta`;
        causal bottom-right when `causal`) as (out, lse), or None for the engine's kernel."""
        return None

    def stats(self) -> dict:
        return {}


FULL_STEP = StepPlan()


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

    def decode_buffer_tokens(self, max_context: int | None = None) -> int:
        """With offload, tokens of KV the runtime keeps on the device per decode row and
        offloaded layer besides the cache (Quest's `reuse_pages`, `prefetch`), counted when
        the device memory is planned, for contexts up to max_context (None: any)."""
        return 0

    def decode_scratch_bytes(self, *, num_heads: int, num_kv_heads: int, head_dim: int, rows: int,
                             max_context: int, block_size: int) -> int:
        """Device bytes a decode step's selection holds at once (scores and the like), for
        `rows` rows of up to max_context tokens in blocks of block_size, with the heads of
        one rank: counted in the memory plan ("decode_scratch")."""
        return 0

    def prefill_chunk_tokens(self) -> int:
        """The prefill chunk (tokens) a sparse prefill method estimates best in, for methods
        that estimate a chunk from its own last queries: where max_num_batched_tokens is
        unset, the engine's default chunk on CUDA grows to it (up to max_model_len). 0: any."""
        return 0

    def offload_device_layers(self, num_layers: int) -> tuple[int, ...]:
        """Layers whose KV stays on the device too when the cache is offloaded: those that
        read their whole context every decode step, while other layers read only what the
        policy selects (loading them through the ring would dominate such a step). Its
        runtime declares the same layers (`PolicyTraits.device_layers`)."""
        return ()

    @property
    def keeps_keys_on_device(self) -> bool:
        """Whether `offload_key_layers` names any layer (of a model with more than the
        policy's dense layers)."""
        return False

    def offload_key_layers(self, num_layers: int) -> tuple[int, ...]:
        """Layers whose keys the device keeps a copy of when the cache is offloaded: the
        pages the policy selects there are then gathered with their keys from the device and
        only their values over PCIe (kvcache.OffloadEngine.gather_pages). Counted in the
        memory plan; none by default."""
        return ()
