"""CPU tests for the Quest ops (astream.ops.quest: page bounds; astream.ops.pages: the newest
block added to a selection, attention over selected pages) against brute force, and their
Triton kernels against the torch references in interpreter mode (in a subprocess). The page
gather: test_quest_gather."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import run_interpreted_check

from astream.ops import pages as page_ops, quest
from astream.ops.attention_ref import paged_decode_attention_ref
from astream.ops.quest_select import select_pages

INF = float("inf")


def make_cache(ctx_lens, kv_heads, head_dim, block_size, num_blocks, seed,
               dtype=torch.float32, head_major=False):
    """Random caches [num_blocks, block_size, KVH, D] (a head-major storage permuted, when
    asked: non-standard strides), shuffled block tables with garbage past each context."""
    gen = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, kv_heads, block_size, head_dim) if head_major else \
        (2, num_blocks, block_size, kv_heads, head_dim)
    storage = torch.randn(shape, generator=gen).to(dtype)
    if head_major:
        storage = storage.transpose(2, 3)
    tables = shuffled_tables([-(-n // block_size) for n in ctx_lens], num_blocks, gen)
    return storage[0], storage[1], tables, torch.tensor(ctx_lens, dtype=torch.int32)


def shuffled_tables(n_blocks: list[int], num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Block tables of sequences holding n_blocks blocks each, drawn without repeats from a
    shuffled pool of num_blocks; a garbage id past each sequence's blocks."""
    tables = torch.full((len(n_blocks), max(n_blocks) + 1), 10**6, dtype=torch.int32)
    free = torch.randperm(num_blocks, generator=gen)
    start = 0
    for b, n in enumerate(n_blocks):
        tables[b, :n] = free[start:start + n]
        start += n
    return tables


# ---- page bounds -----------------------------------------------------------------------

class BoundsWorld:
    """A cache of keys plus Quest bounds, with each page's current owner's tokens tracked."""

    def __init__(self, num_blocks=8, block_size=32, page=16, kvh=2, dim=8, dtype=torch.bfloat16):
        self.bs, self.page, self.kvh, self.dim, self.dtype = block_size, page, kvh, dim, dtype
        self.store = torch.zeros(num_blocks * block_size, kvh, dim)      # the stored values
        self.kmin, self.kmax = quest.allocate_page_bounds(num_blocks, block_size, kvh, dim,
                                                          dtype=dtype, device="cpu",
                                                          page_size=page)
        self.filled: dict[int, int] = {}  # page -> tokens its owner has written
        self.gen = torch.Generator().manual_seed(0)

    def write(self, runs, pad_slot=None):
        """runs: (blocks, first token, count) per sequence, all written in one call."""
        slots = []
        for blocks, first, count in runs:
            for t in range(first, first + count):
                slots.append(blocks[t // self.bs] * self.bs + t % self.bs)
                page = slots[-1] // self.page
                self.filled[page] = t % self.page + 1
        live = len(slots)
        if pad_slot is not None:  # CUDA-graph padding rows all land on one scratch slot
            slots += [pad_slot] * 3
        keys = (torch.randn(len(slots), self.kvh, self.dim, generator=self.gen) * 50).to(self.dtype)
        slots = torch.tensor(slots)
        self.store[slots[:live]] = keys[:live].float()
        quest.update_page_bounds(self.kmin, self.kmax, keys, slots, self.page)

    def check(self):
        for page, n in self.filled.items():
            keys = self.store[page * self.page: page * self.page + n]
            assert self.kmin.dtype == self.kmax.dtype == self.dtype
            assert torch.equal(self.kmin[page].float(), keys.amin(0)), page
            assert torch.equal(self.kmax[page].float(), keys.amax(0)), page


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_update_page_bounds_prefill_decode_reuse(dtype):
    """Bounds in the cache's element type (fp8 ones hold stored fp8 keys) are exact."""
    world = BoundsWorld(dtype=dtype)
    a, b = [3, 1, 6], [0, 2]
    world.write([(a, 0, 20), (b, 0, 40)])       # prefill: several tokens per page
    world.write([(a, 20, 25)])                  # a chunk that starts mid-page
    world.check()
    for t in range(8):                           # decode: one token per sequence per call
        world.write([(a, 45 + t, 1), (b, 40 + t, 1)], pad_slot=7 * 32)
        world.check()
    for page in [p for p in world.filled if p // 2 in a]:
        del world.filled[page]                   # a is freed; c reuses two of its blocks
    c = [1, 3]
    world.write([(c, 0, 10)])
    world.write([(c, 10, 1)])
    world.check()
    world.write([(c, 11, 30)])
    world.check()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn,
                                   torch.float8_e5m2])
def test_update_page_bounds_in_any_row_order_matches_brute_force(dtype):
    """The reference's contract for rows in any order: a page's tokens among other pages',
    its offset-0 token anywhere (the page restarts), one slot written many times, and
    mid-page tokens of a page never written (folded into its empty bounds)."""
    gen = torch.Generator().manual_seed(7)
    num_blocks, block, page, kvh, dim = 6, 32, 16, 2, 8
    kmin, kmax = quest.allocate_page_bounds(num_blocks, block, kvh, dim, dtype=dtype,
                                            device="cpu", page_size=page)
    want_lo = torch.full(kmin.shape, INF)
    want_hi = torch.full(kmin.shape, -INF)
    touched = set()
    for _ in range(6):
        slots = torch.randint(0, num_blocks * block, (40,), generator=gen)
        keys = (torch.randn(40, kvh, dim, generator=gen) * 50).to(dtype)
        quest.update_page_bounds(kmin, kmax, keys, slots, page)
        for p in set((slots // page).tolist()):
            rows = slots // page == p
            lo, hi = keys[rows].float().amin(0), keys[rows].float().amax(0)
            if not (slots[rows] % page == 0).any():
                lo, hi = torch.minimum(lo, want_lo[p]), torch.maximum(hi, want_hi[p])
            want_lo[p], want_hi[p] = lo, hi
        touched |= set((slots // page).tolist())
        pages = sorted(touched)
        assert torch.equal(kmin[pages].float(), want_lo[pages])
        assert torch.equal(kmax[pages].float(), want_hi[pages])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn, torch.float8_e5m2])
def test_bounds_of_blocks_and_store(dtype):
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(3, 32, 2, 8, generator=gen).to(dtype)
    valid = torch.tensor([32, 20, 0])
    lo, hi = quest.bounds_of_blocks(keys, 16, valid)
    empty_lo, empty_hi = quest.allocate_page_bounds(1, 16, 2, 8, dtype=dtype, device="cpu")
    assert lo.shape == (6, 2, 8) and lo.dtype == keys.dtype
    for n in range(3):
        for j in range(2):
            part = keys[n, j * 16: min((j + 1) * 16, int(valid[n]))].float()
            if len(part):
                assert torch.equal(lo[n * 2 + j].float(), part.amin(0))
                assert torch.equal(hi[n * 2 + j].float(), part.amax(0))
            else:
                assert torch.equal(lo[n * 2 + j].float(), empty_lo[0].float())
                assert torch.equal(hi[n * 2 + j].float(), empty_hi[0].float())
    kmin, kmax = quest.allocate_page_bounds(10, 32, 2, 8, dtype=dtype, device="cpu")
    quest.store_block_bounds(kmin, kmax, keys[:2], torch.tensor([7, 2]), 16)
    assert torch.equal(kmin[[14, 15, 4, 5]].float(), quest.bounds_of_blocks(keys[:2])[0].float())
    assert torch.equal(kmax[[0, 1, 16]].float(), empty_hi[[0, 0, 0]].float())


# ---- the newest block's pages ------------------------------------------------------

def test_newest_block_pages_follow_the_selected_ones():
    indices = torch.tensor([[[0, 1, 3, 3], [1, 2, 2, 2]]], dtype=torch.int32)    # B=1, KVH=2
    counts = torch.tensor([[3, 2]], dtype=torch.int32)
    pages, total = page_ops.with_newest_block(indices, counts, torch.tensor([64]), block_size=32,
                                              page_size=16)
    assert total.tolist() == [[5, 4]]
    assert pages[0, 0, :5].tolist() == [0, 1, 3, 4, 5]          # block 2 starts at page 4
    assert pages[0, 1, :4].tolist() == [1, 2, 4, 5]
    assert pages.shape == (1, 2, 6)


# ---- attention over selected pages ---------------------------------------------------

def selected_case(ctx_lens, group, dim, block, page, budget, seed, dtype=torch.float32,
                  head_major=False, kvh=2):
    """Caches, tables and a Quest selection (random scores) with some counts cut short."""
    k_cache, v_cache, tables, lens = make_cache(ctx_lens, kvh, dim, block, 24, seed, dtype,
                                                head_major)
    gen = torch.Generator().manual_seed(seed + 100)
    q = torch.randn(len(ctx_lens), kvh * group, dim, generator=gen).to(dtype)
    num_pages = (lens + page - 1) // page
    scores = torch.randn(len(ctx_lens), kvh, int(num_pages.max()) + 2, generator=gen)
    pages, counts = select_pages(scores, num_pages, budget)
    counts = counts.clone()
    counts[-1, 0] = counts[-1, 0] // 2  # fewer than selected: the rest must be ignored
    return q, k_cache, v_cache, tables, pages, counts, lens


def naive_selected(q, k_cache, v_cache, tables, pages, counts, lens, page, scale):
    """Float64 dense attention over exactly the selected pages' tokens, one head at a time."""
    batch, heads, dim = q.shape
    kvh, block = k_cache.shape[2], k_cache.shape[1]
    out = torch.zeros(batch, heads, dim, dtype=torch.float64)
    lse = torch.full((batch, heads), -INF, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            g = h // (heads // kvh)
            toks = [p * page + t for p in pages[b, g, :int(counts[b, g])].tolist()
                    for t in range(page) if p * page + t < int(lens[b])]
            if not toks:
                continue
            blk = [int(tables[b, t // block]) for t in toks]
            keys = torch.stack([k_cache[x, t % block, g] for x, t in zip(blk, toks)]).double()
            vals = torch.stack([v_cache[x, t % block, g] for x, t in zip(blk, toks)]).double()
            s = keys @ q[b, h].double() * scale
            lse[b, h] = torch.logsumexp(s, 0)
            out[b, h] = torch.softmax(s, 0) @ vals
    return out, lse


@pytest.mark.parametrize("group,head_major", [(1, False), (4, True)])
def test_selected_reference_matches_masked_dense(group, head_major):
    args = selected_case([0, 5, 40, 77, 130], group, 32, 32, 16, 3, seed=group,
                         head_major=head_major)
    out, lse = page_ops.paged_decode_selected(*args, page_size=16, scale=0.2)
    want_out, want_lse = naive_selected(*args, page=16, scale=0.2)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    assert torch.all(out[0] == 0) and torch.all(torch.isneginf(lse[0]))


def test_selected_reference_all_pages_is_full_attention():
    ctx = [1, 16, 17, 100, 64]
    q, kc, vc, tables, _, _, lens = selected_case(ctx, 2, 64, 32, 16, 3, seed=5)
    num_pages = (lens + 15) // 16
    pages, counts = select_pages(torch.randn(5, 2, 7), num_pages, budget_pages=7)
    assert torch.equal(counts, num_pages.view(-1, 1).expand(5, 2).int())
    out, lse = page_ops.paged_decode_selected(q, kc, vc, tables, pages, counts, lens,
                                           page_size=16, scale=0.125)
    ref_out, ref_lse = paged_decode_attention_ref(q, kc, vc, tables, lens, scale=0.125,
                                                  max_context_len=100)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


# ---- Triton kernels vs references (interpreter on CPU) ------------------------------

f32, f16 = torch.float32, torch.float16
# (ctx lens, group, dim, block, page, budget, splits, use_dot, dtype, head_major)
SELECTED_CASES = [
    ([0, 5, 40, 77, 130], 1, 64, 32, 16, 3, None, None, f32, False),
    ([0, 5, 40, 77, 130], 4, 64, 32, 16, 4, 2, None, f32, True),
    ([33, 100], 3, 32, 16, 8, 5, 3, True, f32, False),
    ([33, 100], 2, 32, 16, 16, 3, 1, False, f32, False),
    ([70, 9], 2, 64, 32, 16, 3, 2, None, f16, False),
    ([30, 19], 2, 8, 8, 4, 3, 2, None, f32, False),  # head_dim < 16: no tl.dot
]


def check_triton_quest(device: str, tol32: float, tol16: float) -> int:
    """The selected-pages decode kernel vs its reference (the gather: test_quest_gather);
    returns the number of cases checked."""
    from astream.ops import triton_pages
    n = 0
    for i, (ctx, group, dim, block, page, budget, splits, dot, dtype, hm) in \
            enumerate(SELECTED_CASES):
        args = [t.to(device) for t in selected_case(ctx, group, dim, block, page, budget,
                                                    seed=20 + i, dtype=dtype, head_major=hm)]
        kw = dict(page_size=page, scale=dim ** -0.5)
        out, lse = triton_pages.paged_decode_selected_triton(*args, num_splits=splits,
                                                             use_dot=dot, **kw)
        ref_out, ref_lse = page_ops.paged_decode_selected_ref(args[0].float(), *args[1:], **kw)
        assert out.dtype == dtype and lse.dtype == f32
        tol = tol32 if dtype == f32 else tol16
        torch.testing.assert_close(out.float(), ref_out, atol=tol, rtol=tol)
        torch.testing.assert_close(lse, ref_lse, atol=tol32, rtol=tol32)
        n += 1
    n += check_triton_quest_fp8(device, tol16)
    return n


def check_triton_quest_fp8(device: str, tol: float) -> int:
    """Selected-pages decode over fp8 caches with per-head scales, kernel vs reference."""
    from astream.ops import triton_pages
    from test_ops import fp8_cache
    cases = [(1, torch.float16, torch.float8_e4m3fn), (4, torch.float16, torch.float8_e5m2)]
    for seed, (case, q_dtype, kv_dtype) in enumerate(cases):
        ctx, group, dim, block, page, budget, splits, dot, _, hm = SELECTED_CASES[case]
        q, kc, vc, *rest = selected_case(ctx, group, dim, block, page, budget, seed=40 + seed,
                                         head_major=hm)
        gen = torch.Generator().manual_seed(seed)
        (kc, ks), (vc, vs) = fp8_cache(kc, kv_dtype, gen), fp8_cache(vc, kv_dtype, gen)
        args = [t.to(device) for t in (q.to(q_dtype), kc, vc, *rest)]
        kw = dict(page_size=page, scale=dim ** -0.5, kv_scales=(ks.to(device), vs.to(device)))
        out, lse = triton_pages.paged_decode_selected_triton(*args, num_splits=splits, **kw)
        ref_out, ref_lse = page_ops.paged_decode_selected_ref(args[0].float(), *args[1:], **kw)
        torch.testing.assert_close(out.float(), ref_out, atol=tol, rtol=tol)
        torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)
    return len(cases)


N_TRITON_CASES = len(SELECTED_CASES) + 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the compiled kernels are tested")
def test_triton_quest_interpreter_matches_reference():
    assert run_interpreted_check("test_quest_ops", "check_triton_quest", 1e-4, 2e-3) == N_TRITON_CASES


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_quest_on_gpu_matches_reference():
    assert check_triton_quest("cuda", tol32=5e-3, tol16=5e-3) == N_TRITON_CASES


def test_dispatch_cpu_is_reference():
    assert quest.select_quest_backend("cpu") == "reference"
