"""Quest (Tang et al., ICML 2024): query-aware selection of the KV pages a decode step reads.

Per page (`page_size` tokens, inside a KV block), layer and KV head, the element-wise
min and max of the stored keys (after RoPE) are kept on the device, updated as keys are
written. At decode, a page's criticality for a query head is the sum over channels of
max(q_i * min_i, q_i * max_i), an upper bound of q.k over the page; a KV head scores a
page by the max over its query heads' scores, each less that head's best page's
(`gqa_reduce="relative"`, the default), so heads whose scores run larger do not take the
budget from the others; "max" takes the plain max, "sum" the sum
(ops.quest_select.reduce_heads). Each
sequence and KV head reads its top pages within `budget_tokens`, chosen among the pages
of its full KV blocks and always with the first (the attention sink) and the newest of
them; the sequence's newest, unfinished block is read whole besides (it is the device
tail with offload, so both paths read the same pages). The first `dense_layers` layers
read everything, as in the paper. A budget that covers the context is full attention.
The reference code is written for multi-head attention (each query head its own pages);
one selection per KV head reads the budget once per group (docs/BENCHMARKS.md, "Agreement
with the authors' code").

With offload, `reuse_pages=True` keeps each layer's selected pages on the device from one
decode step to the next and loads over PCIe only those a row did not hold
(policies.quest.page_reuse, through `load_pages`). `prefetch=F` (F >= 1) also takes most of
the loading off the step's critical path: during layer l-1, layer l's query is predicted
from the residual stream entering layer l-1 (Decoder.early_query), its top F x budget pages
are selected and load into layer l's page buffers on the engine's prefetch stream, while
layer l-1 computes; layer l then selects with its own query as always and loads only the
pages the prediction missed. The prediction decides only what is loaded early, never what
attention reads, so the tokens are those of plain Quest. With `late_fetch=False` as well,
attention reads the prediction's pages (F x budget of them) and the layer neither selects
nor loads anything itself: no load is left in a layer's path, and the pages read are the
predicted query's choice, not the exact one, so the tokens may part from plain Quest's
(their accuracy is measured in docs/BENCHMARKS.md); the prediction's pages load in the order
chosen, or, with `reuse_pages`, only those a row's slots do not hold. Either costs device memory, counted
when the engine plans it: per offloaded layer, two buffers of max_num_seqs x KV heads x
max(1, F) x budget_tokens x head_dim.

With offload, `keys_on_device=True` keeps a device copy of every selecting layer's keys
beside the host pool (written as the keys leave for the host): the selected pages are then
gathered with their keys from device memory and only their values over PCIe, half the bytes
of a step's gather. It costs half the host pool's size in device memory, counted in the
memory plan (`device_keys`); the tokens are plain Quest's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from astream.ops import quest as ops
from astream.ops.quest_select import group_budget, select_decode_pages, select_decode_pages_grouped
from astream.policies.base import (
    DecodeQuery, HostPages, KVLayout, PageSelection, PolicyRuntime, PolicyTraits, PrefetchedPages,
    SparsePolicy, check_int,
)
from astream.policies.quest.page_reuse import EARLY, LATE, PageReuse, plan_reuse_


@dataclass(slots=True, frozen=True)
class QuestPolicy(SparsePolicy):
    budget_tokens: int = 4096
    page_size: int = 16
    dense_layers: int = 2
    sink_pages: int = 1
    recent_pages: int = 1
    gqa_reduce: str = "relative"
    reuse_pages: bool = False
    prefetch: float = 0.0            # 0: off; else pages predicted a layer ahead, x the budget
    keys_on_device: bool = False     # with offload: selecting layers' keys kept on the device too
    late_fetch: bool = True          # with prefetch: False reads the predicted pages only
    # Two-level selection above group_above_pages pages (docs/ENGINE.md, Quest): groups of
    # group_pages pages of a block, kept holding group_factor x the budget's pages.
    group_pages: int = 16
    group_above_pages: int = 16384
    group_factor: int = 4
    name = "quest"
    phase = "decode"

    def __post_init__(self) -> None:
        for key in ("budget_tokens", "page_size", "group_pages", "group_factor"):
            check_int("QuestPolicy", key, getattr(self, key), 1)
        for key in ("dense_layers", "sink_pages", "recent_pages", "group_above_pages"):
            check_int("QuestPolicy", key, getattr(self, key), 0)
        for key in ("page_size", "group_pages"):
            if getattr(self, key) & (getattr(self, key) - 1):
                raise ValueError(f"QuestPolicy {key} must be a power of two, got {getattr(self, key)}")
        if self.budget_tokens < self.page_size * max(1, self.sink_pages + self.recent_pages):
            raise ValueError(f"QuestPolicy budget_tokens {self.budget_tokens} must hold at least the "
                             f"sink and recent pages ({self.sink_pages + self.recent_pages} of "
                             f"{self.page_size} tokens)")
        for key in ("reuse_pages", "keys_on_device", "late_fetch"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"QuestPolicy {key} must be True or False, got {getattr(self, key)!r}")
        if (isinstance(self.prefetch, bool) or not isinstance(self.prefetch, (int, float))
                or not (self.prefetch == 0 or 1 <= self.prefetch <= 8)):
            raise ValueError(f"QuestPolicy prefetch must be 0 (off) or a multiple of the budget "
                             f"from 1 to 8, got {self.prefetch!r}")
        if not self.late_fetch and not self.prefetch:
            raise ValueError("QuestPolicy late_fetch=False reads the pages a prefetch predicted: "
                             "it needs prefetch >= 1")
        if self.gqa_reduce not in ops.GQA_REDUCTIONS:
            raise ValueError(f"QuestPolicy gqa_reduce must be one of {ops.GQA_REDUCTIONS}, "
                             f"got {self.gqa_reduce!r}")

    @property
    def budget_pages(self) -> int:
        return self.budget_tokens // self.page_size

    def kv_overhead(self, num_layers: int, block_size: int = 0) -> float:
        # min and max of K per page: 2 * K / page_size = (K + V) / page_size, on sparse layers;
        # and per group of pages, where a block holds whole groups.
        groups = 1 / self.group_pages if self.keeps_groups(block_size) else 0.0
        return max(0, num_layers - self.dense_layers) / max(1, num_layers) / self.page_size * (1 + groups)

    def keeps_groups(self, block_size: int) -> bool:
        """Whether blocks of block_size tokens (0: any) hold whole groups of pages."""
        return self.group_pages > 1 and block_size % (self.page_size * self.group_pages) == 0

    @property
    def buffer_pages(self) -> int:
        """Pages a decode row's page buffer holds per offloaded layer and KV head (0: none)."""
        if self.prefetch:
            return math.ceil(self.prefetch * self.budget_pages)
        return self.budget_pages if self.reuse_pages else 0

    @property
    def prefetch_pages(self) -> int:
        """Pages a predicted query selects a layer ahead (0: no prefetch)."""
        return self.buffer_pages if self.prefetch else 0

    def decode_buffer_tokens(self, max_context: int | None = None) -> int:
        if max_context is not None and max_context <= self.budget_tokens:     # never selects
            return 0
        return self.buffer_pages * self.page_size

    def decode_scratch_bytes(self, *, num_heads: int, num_kv_heads: int, head_dim: int, rows: int,
                             max_context: int, block_size: int) -> int:
        """The largest tensors a selection holds at once, float32: the scores of every page
        (or group of pages) per KV head, and per query head as well with "relative"; in two
        levels also each query head's scores of the candidate pages and their gathered
        bounds (a 2-byte and a float32 copy of both). A step whose contexts stay under
        `group_above_pages` selects in one level even where max_context would take two, so
        the larger of both counts. With `prefetch`, the predicted query's selection of
        `prefetch_pages` runs on its own stream beside a layer's own."""
        if max_context <= self.budget_tokens:
            return 0
        pages = -(-max_context // self.page_size)
        scored = num_kv_heads + (num_heads if self.gqa_reduce == "relative" else 0)
        two_levels = self.keeps_groups(block_size) and pages > self.group_above_pages
        one_level = 4 * rows * (min(pages, self.group_above_pages) if two_levels else pages) * scored

        def selection(budget_pages: int) -> int:
            if not two_levels:
                return one_level
            candidates = group_budget(budget_pages, self.group_pages, self.group_factor) \
                * self.group_pages
            groups = -(-pages // self.group_pages)
            bounds = rows * candidates * 2 * num_kv_heads * head_dim * (2 + 4)
            two_level = 4 * rows * (groups * scored + candidates * 3 * num_heads) + bounds
            return max(one_level, two_level)

        return selection(self.budget_pages) + (selection(self.prefetch_pages) if self.prefetch else 0)

    def offload_device_layers(self, num_layers: int) -> tuple[int, ...]:
        dense = min(self.dense_layers, num_layers)
        return tuple(range(dense)) if dense < num_layers else ()

    @property
    def keeps_keys_on_device(self) -> bool:
        return self.keys_on_device

    def offload_key_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layers that select pages, where `keys_on_device`."""
        if not self.keys_on_device:
            return ()
        return tuple(range(min(self.dense_layers, num_layers), num_layers))

    def bind(self, layout: KVLayout) -> "QuestRuntime":
        ops.pages_per_block(layout.block_size, self.page_size)          # raises if they do not fit
        bounds = [ops.allocate_page_bounds(layout.num_blocks, layout.block_size, layout.num_kv_heads,
                                           layout.head_dim, dtype=layout.key_dtype, device=layout.device,
                                           page_size=self.page_size)
                  if layer >= self.dense_layers else None for layer in range(layout.num_layers)]
        counters = torch.zeros(layout.num_layers, 2, dtype=torch.int64, device=layout.device)
        sparse = frozenset(layer for layer, found in enumerate(bounds) if found is not None)
        reuse = layout.offload and self.buffer_pages > 0
        traits = PolicyTraits(
            watches_keys=bool(sparse), decode_layers=sparse, select_above=self.budget_tokens,
            loads_pages=reuse, prefetches=reuse and self.prefetch > 0, device_layers=frozenset(
                self.offload_device_layers(layout.num_layers) if layout.offload else ()))
        grouped = self.keeps_groups(layout.block_size)
        groups = [ops.allocate_page_bounds(layout.num_blocks, layout.block_size, layout.num_kv_heads,
                                           layout.head_dim, dtype=layout.key_dtype, device=layout.device,
                                           page_size=self.page_size * self.group_pages)
                  if grouped and b is not None else None for b in bounds]
        return QuestRuntime(self, layout, bounds, counters, groups,
                            PageReuse(layout.max_num_seqs, layout.num_layers) if reuse else None,
                            traits=traits)


@dataclass(slots=True)
class QuestRuntime(PolicyRuntime):
    policy: QuestPolicy
    layout: KVLayout
    bounds: list[tuple[Tensor, Tensor] | None]     # per layer (kmin, kmax), None on dense layers
    counters: Tensor                               # [layers, 2]: pages read, (sequence, head) rows
    groups: list[tuple[Tensor, Tensor] | None]     # per layer bounds of groups of pages, or None
    reuse: PageReuse | None = None                 # reuse_pages with offload: the rows' page buffers

    def on_kv_written(self, layer: int, keys: Tensor, slots: Tensor) -> None:
        if self.bounds[layer] is not None:
            kmin, kmax = self.bounds[layer]
            ops.update_page_bounds(kmin, kmax, keys, slots, self.policy.page_size)
        if self.groups[layer] is not None:
            ops.update_page_bounds(*self.groups[layer], keys, slots,
                                   self.policy.page_size * self.policy.group_pages)

    def select_decode(self, layer: int, query: DecodeQuery) -> PageSelection:
        return self._select(layer, query, self.policy.budget_pages, self.counters[layer])

    def _select(self, layer: int, query: DecodeQuery, budget_pages: int,
                counters: Tensor | None) -> PageSelection:
        policy = self.policy
        kmin, kmax = self.bounds[layer]
        max_pages = -(-query.max_context // policy.page_size)
        kw = dict(max_pages=max_pages, block_size=self.layout.block_size,
                  page_size=policy.page_size, budget_pages=budget_pages,
                  sink_pages=policy.sink_pages, recent_pages=policy.recent_pages,
                  gqa_reduce=policy.gqa_reduce, append_newest=query.append_newest,
                  physical=query.physical, counters=counters)
        if self.groups[layer] is not None and max_pages > policy.group_above_pages:
            chosen = select_decode_pages_grouped(
                query.q, kmin, kmax, *self.groups[layer], query.block_tables, query.context_lens,
                group_pages=policy.group_pages, group_factor=policy.group_factor, **kw)
        else:
            chosen = select_decode_pages(query.q, kmin, kmax, query.block_tables,
                                         query.context_lens, **kw)
        return PageSelection(chosen.indices, chosen.counts, policy.page_size, chosen.physical)

    def load_pages(self, layer: int, chosen: PageSelection, pool: HostPages,
                   owners: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
        """The chosen pages through the layer's page buffers: only pages a row's slots do not
        hold are read from the host pool (policies.quest.page_reuse)."""
        return self._through_buffers(layer, chosen, pool, owners, LATE)

    def prefetch_pages(self, layer: int, query: DecodeQuery, pool: HostPages,
                       owners: Tensor) -> PrefetchedPages | None:
        """The predicted query's top `prefetch_pages` pages into the layer's page buffers.
        Without `late_fetch` they are what the layer reads (and counts as read): with
        `reuse_pages` only those a row's slots do not hold load, else all of them, in the
        order chosen, with no reuse plan on the prefetch's stream."""
        if self.policy.late_fetch:
            self._through_buffers(layer, self._select(layer, query, self.policy.prefetch_pages, None),
                                  pool, owners, EARLY)
            return None
        chosen = self._select(layer, query, self.policy.prefetch_pages, self.counters[layer])
        if self.policy.reuse_pages:
            reused = self._through_buffers(layer, chosen, pool, owners, EARLY)
            return PrefetchedPages(chosen, *(reused or (None, None)))
        found = self._buffers(layer, chosen)
        if found is None:
            return PrefetchedPages(chosen, None, None)
        rows = chosen.physical.shape[0]
        k, v, _, owner = found
        pool.gather_pages(layer, chosen.physical, chosen.counts, chosen.page_size,
                          into=(k[:rows], v[:rows]), background=True)
        owner[:rows].fill_(-1)                  # what the slots held is not known to a plan
        self.reuse.loaded[layer, EARLY] += chosen.counts.sum()
        return PrefetchedPages(chosen, k[:rows], v[:rows])

    def _buffers(self, layer: int, chosen: PageSelection) -> tuple[Tensor, ...] | None:
        """The layer's page buffers for the rows of `chosen` (reuse.layer), or None."""
        rows, kv_heads, _ = chosen.physical.shape
        layout = self.layout
        if self.reuse is None or rows > self.reuse.rows:
            return None
        return self.reuse.layer(layer, kv_heads, self.policy.buffer_pages, chosen.page_size,
                                layout.head_dim, layout.key_dtype, layout.device)

    def _through_buffers(self, layer: int, chosen: PageSelection, pool: HostPages, owners: Tensor,
                         when: int) -> tuple[Tensor, Tensor, Tensor] | None:
        rows = chosen.physical.shape[0]
        found = self._buffers(layer, chosen)
        if found is None:
            return None
        k, v, held, owner = found
        page_list, load_to = plan_reuse_(held[:rows], owner[:rows], chosen.physical, chosen.counts,
                                         owners, self.reuse.loaded[layer, when:when + 1])
        pool.gather_pages(layer, chosen.physical, chosen.counts, chosen.page_size,
                          into=(k[:rows], v[:rows]), dst_pages=load_to, background=when == EARLY)
        return k[:rows], v[:rows], page_list

    def stats(self) -> dict:
        """Per layer: pages read per (sequence, KV head) selection, and pages `reuse_pages`
        loaded into the rows' buffers (reads the device counters)."""
        pages, rows = self.counters.cpu().unbind(1)
        early, late = ([[0] * len(self.bounds)] * 2 if self.reuse is None
                       else self.reuse.pages_loaded())
        return {"quest_pages_read": pages.tolist(), "quest_selections": rows.tolist(),
                "quest_pages_loaded": [a + b for a, b in zip(early, late)],
                "quest_pages_loaded_late": late}

