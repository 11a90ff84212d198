"""Window (StreamingLLM, Xiao et al., ICLR 2024): a decode query reads the first pages of
its context (the attention sink) and the most recent ones, nothing in between.

Per sequence, `sink_pages` pages of `page_size` tokens from the start and the newest pages
up to `budget_tokens` in all; every KV head reads the same pages. No key statistics are
kept, so the policy costs no memory and no work as keys are written, and with offload only
the window's pages cross PCIe. The sequence's newest, unfinished block is read whole
besides, as with Quest. A budget that covers the context is full attention.

Unlike StreamingLLM, the cache keeps every token (positions are not shifted): a later
query may still read the whole context through another policy, and prefill is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from astream.ops.pages import pages_per_block, physical_pages, with_newest_block
from astream.policies.base import (
    DecodeQuery, KVLayout, PageSelection, PolicyRuntime, PolicyTraits, SparsePolicy, check_int,
)


@dataclass(slots=True, frozen=True)
class WindowPolicy(SparsePolicy):
    budget_tokens: int = 2048
    page_size: int = 16
    sink_pages: int = 1
    name = "window"
    phase = "decode"

    def __post_init__(self) -> None:
        for key in ("budget_tokens", "page_size"):
            check_int("WindowPolicy", key, getattr(self, key), 1)
        check_int("WindowPolicy", "sink_pages", self.sink_pages, 0)
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"WindowPolicy page_size must be a power of two, got {self.page_size}")
        if self.budget_tokens < self.page_size * (self.sink_pages + 1):
            raise ValueError(f"WindowPolicy budget_tokens {self.budget_tokens} must hold the sink "
                             f"pages and at least one recent page ({self.sink_pages + 1} of "
                             f"{self.page_size} tokens)")

    @property
    def budget_pages(self) -> int:
        return self.budget_tokens // self.page_size

    def bind(self, layout: KVLayout) -> "WindowRuntime":
        pages_per_block(layout.block_size, self.page_size)            # raises if they do not fit
        # Every layer selects once a context outgrows the budget; no key is watched.
        traits = PolicyTraits(decode_layers=frozenset(range(layout.num_layers)),
                              select_above=self.budget_tokens)
        return WindowRuntime(self, layout, traits=traits)


@dataclass(slots=True)
class WindowRuntime(PolicyRuntime):
    policy: WindowPolicy
    layout: KVLayout

    def select_decode(self, layer: int, query: DecodeQuery) -> PageSelection:
        policy, batch = self.policy, query.context_lens.shape[0]
        budget, sink = policy.budget_pages, policy.sink_pages
        slot = torch.arange(budget, device=query.context_lens.device)
        num_pages = torch.div(query.context_lens.long() + policy.page_size - 1, policy.page_size,
                              rounding_mode="floor").view(-1, 1)
        # Slots below `sink` hold the first pages, the rest the newest ones; a context that
        # fits the budget is read whole, its spare slots repeating its last page.
        pages = torch.where(slot < sink, slot, num_pages - budget + slot)
        pages = torch.where(num_pages <= budget, slot, pages)
        counts = num_pages.clamp(max=budget)
        pages = torch.where(slot < counts, pages, (counts - 1).clamp(min=0))
        kv_heads = self.layout.num_kv_heads
        indices = pages.to(torch.int32).unsqueeze(1).expand(batch, kv_heads, budget).contiguous()
        counts = counts.to(torch.int32).expand(batch, kv_heads).contiguous()
        if query.append_newest:
            indices, counts = with_newest_block(indices, counts, query.context_lens,
                                                self.layout.block_size, policy.page_size)
        physical = physical_pages(indices, query.block_tables, self.layout.block_size,
                                  policy.page_size) if query.physical else None
        return PageSelection(indices, counts, policy.page_size, physical)
