"""Triton kernels of Quest's per-layer bookkeeping and page selection (CUDA; also run
under TRITON_INTERPRET=1). Torch references and contracts: astream.ops.quest_select
(selection) and astream.ops.quest (bounds).

- bounds update: grid (token, KV head). The first new token of each page folds all of
  that page's new tokens into its bounds, so a prefill chunk's tokens never race (the
  same kernel keeps the bounds of groups of pages, as pages of group_pages x the tokens).
- table scores: grid (batch, KV head, page tile). Logical page -> physical page through
  the block table in the kernel; bounds are widened to q's dtype (exactly, from fp8) and
  go through the tensor cores with q+ and q-, which are exact in it. The group's query
  heads are reduced in the kernel ("max", "sum"); "relative" needs each query head's max
  over every page first, so the kernel writes every query head's row (-inf past the
  context) and torch reduces them (three small kernels; contract: quest_select.reduce_heads,
  which this module does not import, as quest_select dispatches here): a float32 per query
  head and page is little against the page's bounds, 2 x head_dim elements, which a scheme
  that scored the pages twice would read again.
- select: grid (batch, KV head). A bisection over the scores' order-preserving int32
  image finds a threshold that takes the budget (the row's first power-of-two pages,
  up to 16K, held in registers; pages past them re-read from L2 each step), then one
  ordered scan writes the chosen pages ascending (ties at the threshold taken lowest
  page first), the newest block's pages after them, and pads the rest. Nothing leaves
  the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from astream.ops.triton_pages import group_tile
from astream.ops.triton_tiles import NUM_WARPS, _dim_mask, _scores

SCORE_BLOCK_P = 64      # pages per score program
UPDATE_ROWS = 16        # key rows per pass of the bounds update
SELECT_TAIL = 1024      # scores per step of the select kernel's passes past its register head
MAX_ROW_IN_REGISTERS = 16384   # 32 int32 keys a thread at 16 warps
# The scores kernel's group reduction: "max", "sum", or none (each query head's row).
REDUCE_MAX = tl.constexpr(0)
REDUCE_SUM = tl.constexpr(1)
REDUCE_EACH_HEAD = tl.constexpr(2)
# Bisection bounds on the int32 keys: below every key, and above every key.
BELOW_KEYS = tl.constexpr(-2147483648 - 1)
ABOVE_KEYS = tl.constexpr(2147483648)


@triton.jit
def _update_bounds_kernel(
    kmin_ptr, kmax_ptr, keys_ptr, slots_ptr, n_tokens,
    stride_np, stride_nh, stride_xp, stride_xh, stride_kt, stride_kh,
    PAGE: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    page = slot // PAGE
    prev = tl.load(slots_ptr + tl.maximum(t - 1, 0)).to(tl.int64) // PAGE
    # A page's new tokens are consecutive rows (one sequence's run of ascending slots).
    if (t == 0) | (prev != page):
        dims = tl.arange(0, D_PAD)
        lo = tl.full([D_PAD], float("inf"), tl.float32)
        hi = tl.full([D_PAD], float("-inf"), tl.float32)
        # ROWS at a time: a group of pages (Quest's two-level selection) is a page of
        # hundreds of tokens. Only rows up to the last new token can share the page: a
        # decode step's single row takes one pass, not PAGE / ROWS masked ones.
        for first in range(0, tl.minimum(PAGE, n_tokens - t), ROWS):
            rows = t + first + tl.arange(0, ROWS)
            in_range = rows < n_tokens
            row_slots = tl.load(slots_ptr + rows, mask=in_range, other=0).to(tl.int64)
            same = in_range & (row_slots // PAGE == page)
            mask = _dim_mask(same, dims, HEAD_DIM, D_PAD)
            keys = tl.load(keys_ptr + rows[:, None] * stride_kt + h * stride_kh + dims[None, :],
                           mask=mask, other=0.0).to(kmin_ptr.dtype.element_ty).to(tl.float32)
            lo = tl.minimum(lo, tl.min(tl.where(mask, keys, float("inf")), axis=0))
            hi = tl.maximum(hi, tl.max(tl.where(mask, keys, float("-inf")), axis=0))
        dim_ok = dims < HEAD_DIM
        min_at = kmin_ptr + page * stride_np + h * stride_nh + dims
        max_at = kmax_ptr + page * stride_xp + h * stride_xh + dims
        if slot % PAGE != 0:        # the page holds older tokens: fold, else (re)start it
            lo = tl.minimum(lo, tl.load(min_at, mask=dim_ok).to(tl.float32))
            hi = tl.maximum(hi, tl.load(max_at, mask=dim_ok).to(tl.float32))
        tl.store(min_at, lo.to(kmin_ptr.dtype.element_ty), mask=dim_ok)
        tl.store(max_at, hi.to(kmax_ptr.dtype.element_ty), mask=dim_ok)


@triton.jit
def _table_scores_kernel(
    q_ptr, kmin_ptr, kmax_ptr, tables_ptr, lens_ptr, out_ptr, width,
    stride_qb, stride_qh, stride_np, stride_nh, stride_xp, stride_xh, stride_tb,
    stride_ob, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_P: tl.constexpr, PAGE: tl.constexpr, PPB: tl.constexpr, USE_DOT: tl.constexpr,
    PRECISION: tl.constexpr, REDUCE: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    n_pages = tl.cdiv(tl.load(lens_ptr + b), PAGE)
    pos = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    ok = pos < n_pages          # tiles past the context load nothing
    blk = tl.load(tables_ptr + b * stride_tb + pos // PPB, mask=ok, other=0).to(tl.int64)
    ids = blk * PPB + pos % PPB
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, D_PAD)
    q = tl.load(q_ptr + b * stride_qb + (kvh * GROUP + rows)[:, None] * stride_qh + dims[None, :],
                mask=_dim_mask(rows < GROUP, dims, HEAD_DIM, D_PAD), other=0.0)
    mask = _dim_mask(ok, dims, HEAD_DIM, D_PAD)
    compute = q_ptr.dtype.element_ty
    lo = tl.load(kmin_ptr + ids[:, None] * stride_np + kvh * stride_nh + dims[None, :],
                 mask=mask, other=0.0).to(compute)
    hi = tl.load(kmax_ptr + ids[:, None] * stride_xp + kvh * stride_xh + dims[None, :],
                 mask=mask, other=0.0).to(compute)
    # max(q*lo, q*hi) = q+ * hi + q- * lo since lo <= hi.
    q_pos = tl.maximum(q, 0.0).to(compute)
    q_neg = tl.minimum(q, 0.0).to(compute)
    s = _scores(q_pos, hi, USE_DOT, PRECISION) + _scores(q_neg, lo, USE_DOT, PRECISION)
    if REDUCE == REDUCE_EACH_HEAD:    # out [B, H, width]: every page of the tile is written
        heads = kvh * GROUP + rows
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + pos[None, :],
                 tl.where(ok[None, :], s, float("-inf")),
                 mask=(rows < GROUP)[:, None] & (pos < width)[None, :])
    else:
        if REDUCE == REDUCE_SUM:
            s = tl.sum(tl.where((rows < GROUP)[:, None], s, 0.0), axis=0)
        else:
            s = tl.max(tl.where((rows < GROUP)[:, None], s, float("-inf")), axis=0)
        tl.store(out_ptr + b * stride_ob + kvh * stride_oh + pos, s, mask=ok)


@triton.jit
def _rank_keys(row_ptr, pos, n_pages, sink, recent):
    """Order-preserving int32 image of the scores, forced pages highest, NaN lowest (as the
    reference ranks them: an infinite score is the largest or lowest finite one)."""
    score = tl.load(row_ptr + pos, mask=pos < n_pages, other=0.0)
    score = tl.where(score != score, -3.4028234663852886e38, score)
    score = tl.minimum(tl.maximum(score, -3.4028234663852886e38), 3.4028234663852886e38)
    score = tl.where((pos < sink) | (pos >= n_pages - recent), float("inf"), score)
    bits = score.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _count_at_least(row_ptr, keys, lanes, n_pages, sink, recent, mid,
                    HEAD: tl.constexpr, TAIL: tl.constexpr):
    """How many keys are >= mid (an int32): the head's in registers, the tail's re-read."""
    count = tl.sum(((lanes < n_pages) & (keys >= mid)).to(tl.int32), axis=0)
    for start in range(HEAD, n_pages, TAIL):
        pos = start + tl.arange(0, TAIL)
        chunk = _rank_keys(row_ptr, pos, n_pages, sink, recent)
        count += tl.sum(((pos < n_pages) & (chunk >= mid)).to(tl.int32), axis=0)
    return count


@triton.jit
def _bisect_threshold(row, keys, lanes, n_pages, sink, recent, budget,
                      HEAD: tl.constexpr, TAIL: tl.constexpr):
    """(t, count(key >= t), above) for a threshold t that takes the budget, by bisection
    over the int32 keys: it stops at the first t with count(key >= t) == budget (about 20
    of the 33 steps on real scores), else narrows to the largest t with count(key >= t) >=
    budget, where above = count(key > t) says how many of the keys equal to t to keep.
    t is below every key when every page fits."""
    lo = tl.full([], BELOW_KEYS, tl.int64)
    hi = tl.full([], ABOVE_KEYS, tl.int64)
    at_lo = n_pages                           # count(key >= lo)
    above = tl.zeros([], tl.int32)            # count(key >= hi) < budget
    while (hi - lo > 1) & (at_lo > budget):
        mid = (lo + hi) // 2                  # strictly between: always an int32
        count = _count_at_least(row, keys, lanes, n_pages, sink, recent, mid.to(tl.int32),
                                HEAD, TAIL)
        lo = tl.where(count >= budget, mid, lo)
        at_lo = tl.where(count >= budget, count, at_lo)
        above = tl.where(count >= budget, above, count)
        hi = tl.where(count >= budget, hi, mid)
    return tl.maximum(lo, -2147483648).to(tl.int32), at_lo, above


@triton.jit
def _emit_picks(chunk, pos, n_pages, threshold, cut_ties, ties_wanted, taken, ties, last,
                idx_row, phys_row, table_row, PPB: tl.constexpr, WRITE_PHYSICAL: tl.constexpr):
    """Write this piece's picks (key >= threshold; of the keys equal to it, the lowest
    pages first when they must be cut) after the `taken` before it, in page order."""
    valid = pos < n_pages
    chosen = valid & (chunk >= threshold)
    if cut_ties:                # rare (equal scores at the threshold): a second scan
        tie = valid & (chunk == threshold)
        tie_rank = ties + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        chosen = valid & ((chunk > threshold) | (tie & (tie_rank < ties_wanted)))
        ties += tl.sum(tie.to(tl.int32), axis=0)
    slot = taken + tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    tl.store(idx_row + slot, pos, mask=chosen)
    if WRITE_PHYSICAL:
        blk = tl.load(table_row + pos // PPB, mask=chosen, other=0).to(tl.int64)
        tl.store(phys_row + slot, blk * PPB + pos % PPB, mask=chosen)
    taken += tl.sum(chosen.to(tl.int32), axis=0)
    last = tl.maximum(last, tl.max(tl.where(chosen, pos, -1), axis=0))
    return taken, ties, last


@triton.jit
def _select_kernel(
    scores_ptr, lens_ptr, tables_ptr, idx_ptr, counts_ptr, phys_ptr, counters_ptr,
    stride_sb, stride_sh, stride_tb, stride_ib, stride_ih, stride_cb, stride_pb, stride_ph,
    budget, sink, recent, width,
    PAGE: tl.constexpr, PPB: tl.constexpr, HEAD: tl.constexpr, TAIL: tl.constexpr,
    APPEND_NEWEST: tl.constexpr, WRITE_PHYSICAL: tl.constexpr, COUNT: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    n_pages = tl.cdiv(tl.load(lens_ptr + b), PAGE)
    row = scores_ptr + b * stride_sb + h * stride_sh
    lanes = tl.arange(0, HEAD)
    keys = _rank_keys(row, lanes, n_pages, sink, recent)   # the row's head, kept in registers
    threshold, at_threshold, above = _bisect_threshold(row, keys, lanes, n_pages, sink, recent,
                                                       budget, HEAD, TAIL)
    cut_ties = at_threshold > budget
    ties_wanted = budget - above
    idx_row = idx_ptr + b * stride_ib + h * stride_ih
    phys_row = phys_ptr + b * stride_pb + h * stride_ph
    table_row = tables_ptr + b * stride_tb
    taken, ties, last = _emit_picks(
        keys, lanes, n_pages, threshold, cut_ties, ties_wanted, tl.zeros([], tl.int32),
        tl.zeros([], tl.int32), tl.full([], -1, tl.int32), idx_row, phys_row, table_row,
        PPB, WRITE_PHYSICAL)
    for start in range(HEAD, n_pages, TAIL):
        pos = start + tl.arange(0, TAIL)
        taken, ties, last = _emit_picks(
            _rank_keys(row, pos, n_pages, sink, recent), pos, n_pages, threshold, cut_ties,
            ties_wanted, taken, ties, last, idx_row, phys_row, table_row, PPB, WRITE_PHYSICAL)
    if COUNT:
        tl.atomic_add(counters_ptr, taken.to(tl.int64))
        tl.atomic_add(counters_ptr + 1, tl.full([], 1, tl.int64))
    total = taken
    if APPEND_NEWEST:           # the unfinished block after the full ones, read whole
        newest = tl.arange(0, PPB)
        tl.store(idx_row + taken + newest, n_pages + newest)
        if WRITE_PHYSICAL:
            blk = tl.load(table_row + n_pages // PPB).to(tl.int64)
            tl.store(phys_row + taken + newest, blk * PPB + newest)
        total = taken + PPB
        last = n_pages + PPB - 1
    tl.store(counts_ptr + b * stride_cb + h, total)
    # Entries past the count repeat the last real one (0 if none): in range, never read.
    last = tl.maximum(last, 0)
    last_phys = tl.zeros([], tl.int64)
    if WRITE_PHYSICAL:
        last_phys = tl.load(phys_row + tl.maximum(total - 1, 0), mask=total > 0, other=0)
    for start in range(total, width, TAIL):
        pos = start + tl.arange(0, TAIL)
        tl.store(idx_row + pos, last, mask=pos < width)
        if WRITE_PHYSICAL:
            tl.store(phys_row + pos, last_phys, mask=pos < width)


def register_head(rows: int, limit: int = MAX_ROW_IN_REGISTERS) -> int:
    """How many of a row's scores the select kernel ranks once and keeps in registers (a
    power of two, 16 to `limit`); the rest it re-reads from L2 on every bisection step.
    A padded lane costs a step about what it costs real, a re-read page more: take the
    power of two above the row unless that pads more than twice what the one below
    leaves to re-read (8,256 pages: 8,192 and 64 re-read, not 16,384 half padded)."""
    below = 1 << (rows.bit_length() - 1)
    head = below if below == rows or below * 2 - rows > 2 * (rows - below) else below * 2
    cap = 1 << (max(limit, 16).bit_length() - 1)
    return max(16, min(head, cap))


def select_warps_for(head: int) -> int:
    """Warps of the select kernel for a register head of `head` scores: each bisection
    step ends in a block-wide sum, cheaper with fewer warps while the registers last
    (H200, 8K pages, scores included: 28.6 us a call at 8 warps, 30.2 at 16, 30.9 at 4;
    quest_select_sweep.py)."""
    return 8 if head <= 8192 else 16


def update_page_bounds_triton(kmin: Tensor, kmax: Tensor, keys: Tensor, slots: Tensor,
                              page_size: int) -> None:
    """See astream.ops.quest.update_page_bounds; bounds need a contiguous head_dim."""
    n_tokens, kv_heads, head_dim = keys.shape
    if n_tokens == 0:
        return
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    slots = slots.contiguous()
    _update_bounds_kernel[(n_tokens, kv_heads)](
        kmin, kmax, keys, slots, n_tokens, kmin.stride(0), kmin.stride(1), kmax.stride(0),
        kmax.stride(1), keys.stride(0), keys.stride(1), PAGE=page_size,
        ROWS=min(page_size, UPDATE_ROWS), HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim), num_warps=1,
    )


def select_decode_pages_triton(q: Tensor, kmin: Tensor, kmax: Tensor, block_tables: Tensor,
                               context_lens: Tensor, *, max_pages: int, block_size: int,
                               page_size: int, budget_pages: int, sink_pages: int,
                               recent_pages: int, gqa_reduce: str, append_newest: bool,
                               physical: bool, counters: Tensor | None,
                               max_row_in_registers: int = MAX_ROW_IN_REGISTERS,
                               select_warps: int | None = None,
                               ) -> tuple[Tensor, Tensor, Tensor | None]:
    """See astream.ops.quest_select.select_decode_pages_ref (max_row_in_registers: tests)."""
    batch, n_heads, head_dim = q.shape
    kv_heads, ppb = kmin.shape[1], block_size // page_size
    width = budget_pages + (ppb if append_newest else 0)
    device = q.device
    indices = torch.empty(batch, kv_heads, width, dtype=torch.int32, device=device)
    counts = torch.empty(batch, kv_heads, dtype=torch.int32, device=device)
    phys = torch.empty(batch, kv_heads, width, dtype=torch.int64, device=device) if physical else None
    if batch == 0:
        return indices, counts, phys
    q = q if q.stride(-1) == 1 else q.contiguous()
    in_kernel = {"max": REDUCE_MAX.value, "sum": REDUCE_SUM.value}.get(gqa_reduce)
    rows = kv_heads if in_kernel is not None else n_heads
    scores = torch.empty(batch, rows, max(max_pages, 1), dtype=torch.float32, device=device)
    d_pad = triton.next_power_of_2(head_dim)
    group = n_heads // kv_heads
    use_dot, group_pad = group_tile(group, d_pad, None)
    _table_scores_kernel[(batch, kv_heads, triton.cdiv(scores.shape[2], SCORE_BLOCK_P))](
        q, kmin, kmax, block_tables, context_lens, scores, scores.shape[2], q.stride(0), q.stride(1),
        kmin.stride(0), kmin.stride(1), kmax.stride(0), kmax.stride(1), block_tables.stride(0),
        scores.stride(0), scores.stride(1), GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim,
        D_PAD=d_pad, BLOCK_P=SCORE_BLOCK_P, PAGE=page_size, PPB=ppb, USE_DOT=use_dot,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        REDUCE=REDUCE_EACH_HEAD.value if in_kernel is None else in_kernel, num_warps=NUM_WARPS,
    )
    if in_kernel is None:                       # "relative": less each head's best, then the max
        per_head = scores.view(batch, kv_heads, group, -1)
        # In place: no second per-query-head buffer beside this one (the memory plan counts
        # one, QuestPolicy.decode_scratch_bytes).
        scores = per_head.sub_(per_head.amax(dim=-1, keepdim=True)).amax(dim=2)
    phys_arg = phys if physical else indices            # unread placeholder
    counters_arg = counters if counters is not None else counts
    head = register_head(max(max_pages - (ppb if append_newest else 0), 1), max_row_in_registers)
    _select_kernel[(batch, kv_heads)](
        scores, context_lens, block_tables, indices, counts, phys_arg, counters_arg,
        scores.stride(0), scores.stride(1), block_tables.stride(0), indices.stride(0),
        indices.stride(1), counts.stride(0), phys_arg.stride(0), phys_arg.stride(1),
        budget_pages, sink_pages, recent_pages, width, PAGE=page_size, PPB=ppb, HEAD=head,
        TAIL=SELECT_TAIL, APPEND_NEWEST=append_newest, WRITE_PHYSICAL=physical,
        COUNT=counters is not None, num_warps=select_warps or select_warps_for(head),
    )
    return indices, counts, phys
