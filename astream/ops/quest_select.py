"""Quest's decode page selection: which pages of its context each sequence's query reads,
per KV head, within a budget (Tang et al., ICML 2024).

`select_decode_pages` is what a layer calls: scores from the page bounds through the
block tables, the top pages with the sink and recent ones forced, optionally the pages
of the newest (unfinished) block after them and the physical page ids. On CUDA it is two
Triton kernels (astream.ops.triton_quest_select); `select_decode_pages_ref` composes the
torch references below, which the tests also check one by one against brute force.
No op here reads a device value on the host; every output shape follows from input
shapes and host ints, so all of them run inside a captured CUDA graph.

`select_decode_pages_grouped` is the same choice in two levels, for long contexts: the
group bounds (min / max over `group_pages` consecutive pages of a block, kept as page
bounds with a page of page_size * group_pages tokens) pick the top groups by the same
upper-bound score (sink and recent groups forced), then the top pages among theirs. A
step then scores ~1/group_pages of the pages plus the candidates, not every page; with
groups that cover the context it picks exactly what the one-level selection picks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from astream.ops.pages import physical_pages, with_newest_block
from astream.ops.quest import DEFAULT_PAGE_SIZE, GQA_REDUCTIONS, pages_per_block, select_quest_backend


class Selection(NamedTuple):
    indices: Tensor                  # [B, KVH, W] int32 logical pages, ascending; pads repeat
    counts: Tensor                   # [B, KVH] int32 real entries
    physical: Tensor | None          # [B, KVH, W] int64 block * ppb + j, when asked


def select_decode_pages(q: Tensor, kmin: Tensor, kmax: Tensor, block_tables: Tensor,
                        context_lens: Tensor, *, max_pages: int, block_size: int,
                        page_size: int, budget_pages: int, sink_pages: int = 1,
                        recent_pages: int = 1, gqa_reduce: str,
                        append_newest: bool = False, physical: bool = False,
                        counters: Tensor | None = None) -> Selection:
    """`select_decode_pages_ref`'s contract; two Triton kernels on CUDA."""
    args = (q, kmin, kmax, block_tables, context_lens)
    kw = dict(max_pages=max_pages, block_size=block_size, page_size=page_size,
              budget_pages=budget_pages, sink_pages=sink_pages, recent_pages=recent_pages,
              gqa_reduce=gqa_reduce, append_newest=append_newest, physical=physical,
              counters=counters)
    _check_selection(budget_pages, sink_pages, recent_pages, gqa_reduce, block_size, page_size)
    if select_quest_backend(q.device) == "triton":
        from astream.ops import triton_quest_select
        return Selection(*triton_quest_select.select_decode_pages_triton(*args, **kw))
    return select_decode_pages_ref(*args, **kw)


def select_decode_pages_ref(q: Tensor, kmin: Tensor, kmax: Tensor, block_tables: Tensor,
                            context_lens: Tensor, *, max_pages: int, block_size: int,
                            page_size: int, budget_pages: int, sink_pages: int = 1,
                            recent_pages: int = 1, gqa_reduce: str,
                            append_newest: bool = False, physical: bool = False,
                            counters: Tensor | None = None) -> Selection:
    """Pages each (sequence, KV head) of q [B, H, D] reads among the first
    ceil(context_lens / page_size) logical pages of its table (max_pages bounds them):
    `select_pages` over `page_scores_ref`. With `append_newest`, context_lens must be a
    multiple of block_size (the full blocks) and the block after them is added whole
    (`ops.pages.with_newest_block`). `physical` also returns every entry's physical page id.
    `counters` [2] int64, if given, gains the real picks (before the newest block) and
    the number of (sequence, KV head) rows.
    """
    _check_selection(budget_pages, sink_pages, recent_pages, gqa_reduce, block_size, page_size)
    ids, num_pages = physical_page_ids(block_tables, context_lens, max_pages=max_pages,
                                       block_size=block_size, page_size=page_size)
    scores = page_scores_ref(q, kmin, kmax, ids, num_pages, gqa_reduce=gqa_reduce)
    indices, counts = select_pages(scores, num_pages, budget_pages, sink_pages, recent_pages)
    return _finish_selection(indices, counts, block_tables, context_lens, block_size, page_size,
                             append_newest, physical, counters)


def _finish_selection(indices: Tensor, counts: Tensor, block_tables: Tensor, context_lens: Tensor,
                      block_size: int, page_size: int, append_newest: bool, physical: bool,
                      counters: Tensor | None) -> Selection:
    """Count the picks, add the newest block's pages, map them to physical pages if asked."""
    if counters is not None:
        counters[0] += counts.sum()
        counters[1] += counts.numel()
    if append_newest:
        indices, counts = with_newest_block(indices, counts, context_lens, block_size, page_size)
    phys = physical_pages(indices, block_tables, block_size, page_size) if physical else None
    return Selection(indices, counts, phys)


def _check_selection(budget_pages: int, sink_pages: int, recent_pages: int, gqa_reduce: str,
                     block_size: int, page_size: int) -> None:
    pages_per_block(block_size, page_size)
    if budget_pages < max(1, sink_pages + recent_pages):
        raise ValueError(f"budget_pages {budget_pages} < sink_pages + recent_pages")
    if gqa_reduce not in GQA_REDUCTIONS:
        raise ValueError(f"gqa_reduce must be one of {GQA_REDUCTIONS}, not {gqa_reduce!r}")


def physical_page_ids(block_tables: Tensor, context_lens: Tensor, *, max_pages: int,
                      block_size: int, page_size: int = DEFAULT_PAGE_SIZE) -> tuple[Tensor, Tensor]:
    """block_tables [B, max_blocks] int32, context_lens [B] -> page_ids [B, max_pages] int64
    (-1 past each context) and num_pages [B] int32 = ceil(context_len / page_size)."""
    ppb = pages_per_block(block_size, page_size)
    if max_pages > block_tables.shape[1] * ppb:
        raise ValueError(f"max_pages {max_pages} > the {block_tables.shape[1]} table blocks hold")
    pos = torch.arange(max_pages, device=block_tables.device)
    ids = block_tables[:, pos // ppb].long() * ppb + pos % ppb
    num_pages = torch.div(context_lens + page_size - 1, page_size, rounding_mode="floor")
    return torch.where(pos < num_pages.view(-1, 1), ids, -1), num_pages.to(torch.int32)


def page_scores_ref(q: Tensor, kmin: Tensor, kmax: Tensor, page_ids: Tensor, num_pages: Tensor,
                    *, gqa_reduce: str) -> Tensor:
    """Quest criticality: q [B, H, D], bounds [pages, KVH, D], page_ids [B, P] (physical;
    entries at p >= num_pages[b] or < 0 are ignored) -> scores [B, KVH, P] float32.

    Per query head: sum_i max(q_i * min_i, q_i * max_i), an upper bound of q.k over the
    page (unscaled). A KV head's score reduces its query heads' by `gqa_reduce`
    (`reduce_heads`, its normalizers over the valid pages). Invalid pages score -inf.
    """
    if gqa_reduce not in GQA_REDUCTIONS:
        raise ValueError(f"gqa_reduce must be one of {GQA_REDUCTIONS}, not {gqa_reduce!r}")
    batch, n_heads, head_dim = q.shape
    kv_heads = kmin.shape[1]
    pos = torch.arange(page_ids.shape[1], device=q.device)
    valid = (pos < num_pages.view(-1, 1)) & (page_ids >= 0)
    ids = torch.where(valid, page_ids, 0).long()
    qg = q.float().view(batch, kv_heads, n_heads // kv_heads, head_dim)
    # max(q*lo, q*hi) = q+ * hi + q- * lo because lo <= hi: two matmuls, no [.., P, D] max.
    scores = (torch.einsum("bkgd,bpkd->bkgp", qg.clamp(min=0), kmax[ids].float())
              + torch.einsum("bkgd,bpkd->bkgp", qg.clamp(max=0), kmin[ids].float()))
    scores = torch.where(valid.view(batch, 1, 1, -1), scores, float("-inf"))
    return torch.where(valid.unsqueeze(1), reduce_heads(scores, gqa_reduce), float("-inf"))


def reduce_heads(scores: Tensor, gqa_reduce: str) -> Tensor:
    """A KV head's page scores from its query heads': scores [B, KVH, G, P] float32 (-inf at
    pages not to be chosen, which the "relative" normalizer leaves out) -> [B, KVH, P];
    rows without a page to choose come out -inf or NaN.

    - "max", "sum": over the group;
    - "relative": the max over the group of s - (the head's max over the pages): each
      head's best page scores 0 and a page ranks by how far it lies below its own head's
      best, so query heads whose scores run larger do not crowd out the others' pages. A
      KV head's fp8 scale divides every score of its group alike, so it changes no pick.
    """
    if gqa_reduce == "max":
        return scores.amax(dim=2)
    if gqa_reduce == "sum":
        return scores.sum(dim=2)
    if gqa_reduce == "relative":
        return (scores - scores.amax(dim=-1, keepdim=True)).amax(dim=2)
    raise ValueError(f"gqa_reduce must be one of {GQA_REDUCTIONS}, not {gqa_reduce!r}")


def select_pages(scores: Tensor, num_pages: Tensor, budget_pages: int, sink_pages: int = 1,
                 recent_pages: int = 1) -> tuple[Tensor, Tensor]:
    """Top pages per (sequence, KV head): scores [B, KVH, P], num_pages [B] ->
    indices [B, KVH, budget_pages] int32 (logical pages, ascending), counts [B, KVH] int32.

    The first `sink_pages` and the last `recent_pages` pages are always kept, and of equal
    scores the lowest pages; with num_pages <= budget_pages every page is kept (exactly
    full attention). counts = min(num_pages, budget_pages). Entries past counts repeat the
    last selected page (0 when there is none): always in range, but only counts says how
    many are real.
    """
    if budget_pages < max(1, sink_pages + recent_pages):
        raise ValueError(f"budget_pages {budget_pages} < sink_pages + recent_pages")
    n_pages = scores.shape[-1]
    if n_pages == 0:
        none = torch.zeros(*scores.shape[:2], budget_pages, dtype=torch.int32, device=scores.device)
        return none, none[..., 0].contiguous()
    pos = torch.arange(n_pages, device=scores.device)
    limit = num_pages.view(-1, 1, 1).long().clamp(max=n_pages)
    forced = (pos < sink_pages) | (pos >= limit - recent_pages)
    # Any real page must outrank every padding page, even with a -inf or NaN score.
    lowest = torch.finfo(torch.float32).min
    ranked = scores.float().nan_to_num(nan=lowest, posinf=-lowest, neginf=lowest)
    ranked = torch.where(forced, float("inf"), ranked)
    ranked = torch.where(pos < limit, ranked, float("-inf"))
    k = min(budget_pages, n_pages)
    # Equal scores go lowest page first, as the kernel takes them ("relative" ties each
    # query head's best page at 0); topk leaves the order of ties unspecified.
    top = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :k]
    counts = limit.view(-1, 1).clamp(max=budget_pages).expand(scores.shape[:2])
    # After sorting, the real picks come first; pads take the last real one.
    keyed = torch.where(top < limit, top, n_pages)  # -inf picks are exactly the pages >= limit
    return _ascending(keyed.sort(dim=-1).values, counts, budget_pages, n_pages)


def group_budget(budget_pages: int, group_pages: int, group_factor: int) -> int:
    """Groups the first level keeps: their pages hold group_factor x the budget, plus one
    group for a partial last group, so the candidates always hold the budget's pages."""
    return -(-budget_pages * group_factor // group_pages) + 1


def group_forced(sink_pages: int, recent_pages: int, group_pages: int) -> tuple[int, int]:
    """(sink, recent) groups the first level keeps whatever their scores: those holding
    the forced pages (the last group may hold fewer than group_pages of the recent ones)."""
    return -(-sink_pages // group_pages), (-(-recent_pages // group_pages) + 1 if recent_pages else 0)


def select_decode_pages_grouped(q: Tensor, kmin: Tensor, kmax: Tensor, gmin: Tensor, gmax: Tensor,
                                block_tables: Tensor, context_lens: Tensor, *, max_pages: int,
                                block_size: int, page_size: int, group_pages: int,
                                group_factor: int, budget_pages: int, sink_pages: int = 1,
                                recent_pages: int = 1, gqa_reduce: str,
                                append_newest: bool = False, physical: bool = False,
                                counters: Tensor | None = None) -> Selection:
    """`select_decode_pages`'s contract, chosen in two levels. gmin, gmax [pages /
    group_pages, KVH, D]: bounds of groups of `group_pages` pages (group_pages divides
    block_size // page_size; `ops.quest.update_page_bounds` keeps them with a page of
    page_size * group_pages tokens). The first level is `select_decode_pages` over the
    groups (Triton on CUDA), keeping `group_budget` of them; the second scores their pages
    and keeps the top budget_pages, sink and recent pages forced, as `select_pages` does.
    """
    _check_selection(budget_pages, sink_pages, recent_pages, gqa_reduce, block_size, page_size)
    ppb = pages_per_block(block_size, page_size)
    if group_pages < 1 or ppb % group_pages:
        raise ValueError(f"group_pages {group_pages} does not divide the {ppb} pages of a block")
    wanted = group_budget(budget_pages, group_pages, group_factor)
    sink_groups, recent_groups = group_forced(sink_pages, recent_pages, group_pages)
    groups = select_decode_pages(
        q, gmin, gmax, block_tables, context_lens, max_pages=-(-max_pages // group_pages),
        block_size=block_size, page_size=page_size * group_pages,
        budget_pages=max(wanted, sink_groups + recent_groups, 1), sink_pages=sink_groups,
        recent_pages=recent_groups, gqa_reduce=gqa_reduce, physical=True)
    num_pages = torch.div(context_lens + page_size - 1, page_size, rounding_mode="floor")
    indices, counts = _select_in_groups(q, kmin, kmax, groups, num_pages, group_pages,
                                        budget_pages, sink_pages, recent_pages, gqa_reduce)
    return _finish_selection(indices, counts, block_tables, context_lens, block_size, page_size,
                             append_newest, physical, counters)


def _select_in_groups(q: Tensor, kmin: Tensor, kmax: Tensor, groups: Selection, num_pages: Tensor,
                      group_pages: int, budget_pages: int, sink_pages: int, recent_pages: int,
                      gqa_reduce: str) -> tuple[Tensor, Tensor]:
    """The second level: the top pages among the chosen groups' -> (indices, counts) as
    `select_pages` returns them."""
    batch, n_heads, head_dim = q.shape
    kv_heads, width = groups.indices.shape[1:]
    inner = torch.arange(group_pages, device=q.device)
    pages = (groups.indices.long().unsqueeze(-1) * group_pages + inner).flatten(2)  # [B, KVH, C]
    limit = num_pages.view(-1, 1, 1).long()
    real = (torch.arange(width, device=q.device) < groups.counts.unsqueeze(-1))
    valid = real.unsqueeze(-1).expand(-1, -1, -1, group_pages).flatten(2) & (pages < limit)
    ids = torch.where(valid, (groups.physical.unsqueeze(-1) * group_pages + inner).flatten(2), 0)
    heads = torch.arange(kv_heads, device=q.device).view(1, -1, 1)
    qg = q.float().view(batch, kv_heads, n_heads // kv_heads, head_dim)
    # max(q*lo, q*hi) = q+ * hi + q- * lo, as page_scores_ref.
    scores = (torch.einsum("bkgd,bkcd->bkgc", qg.clamp(min=0), kmax[ids, heads].float())
              + torch.einsum("bkgd,bkcd->bkgc", qg.clamp(max=0), kmin[ids, heads].float()))
    # The "relative" normalizer runs over the candidates: every page where the groups cover
    # the context; else the chosen groups' pages, each query head's best group among them
    # (it scores 0 at the first level, the top score).
    scores = reduce_heads(torch.where(valid.unsqueeze(2), scores, float("-inf")), gqa_reduce)
    lowest = torch.finfo(torch.float32).min
    ranked = scores.nan_to_num(nan=lowest, posinf=-lowest, neginf=lowest)
    forced = (pages < sink_pages) | (pages >= limit - recent_pages)
    ranked = torch.where(forced, float("inf"), ranked)
    ranked = torch.where(valid, ranked, float("-inf"))
    k = min(budget_pages, ranked.shape[-1])
    # Candidates run in page order: equal scores go lowest page first, as in select_pages.
    top = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :k]
    counts = limit.view(-1, 1).clamp(max=budget_pages).expand(batch, kv_heads)
    # Invalid picks (only where fewer real pages than the budget exist) sort last.
    past = torch.iinfo(torch.int64).max
    keyed = torch.where(valid.gather(-1, top), pages.gather(-1, top), past)
    return _ascending(keyed.sort(dim=-1).values, counts, budget_pages, past)


def _ascending(ordered: Tensor, counts: Tensor, budget_pages: int, past: int) -> tuple[Tensor, Tensor]:
    """Sorted picks [B, KVH, k] (entries >= past are none) -> indices [B, KVH, budget_pages]
    int32, the first counts real, then the last real one repeated (0 when there is none)."""
    last = ordered.gather(-1, (counts - 1).clamp(min=0).unsqueeze(-1))
    last = torch.where(last < past, last, 0)
    slot = torch.arange(ordered.shape[-1], device=ordered.device)
    ordered = torch.where(slot < counts.unsqueeze(-1), ordered, last)
    if ordered.shape[-1] < budget_pages:
        ordered = torch.cat([ordered, last.expand(*ordered.shape[:2],
                                                  budget_pages - ordered.shape[-1])], -1)
    return ordered.to(torch.int32), counts.to(torch.int32).contiguous()
