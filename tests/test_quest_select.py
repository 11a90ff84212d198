"""CPU tests of Quest's page selection (astream.ops.quest_select): each reference step
against brute force, the fused op's reference against them, and its Triton kernels (and
the bounds-update kernel) against the references in interpreter mode (in a subprocess)."""

from __future__ import annotations


import pytest
import torch
from test_quest_ops import shuffled_tables
from triton_interpreter import run_interpreted_check

from astream.ops import quest
from astream.ops.kv_write import dequantize_ref, quantize_ref
from astream.ops.quest_select import (
    Selection, page_scores_ref, physical_page_ids, select_decode_pages, select_decode_pages_ref,
    select_pages, with_newest_block,
)

INF = float("inf")


def test_physical_page_ids():
    tables = torch.tensor([[5, 2, 9], [4, 10**6, 10**6]], dtype=torch.int32)
    ids, n = physical_page_ids(tables, torch.tensor([50, 7], dtype=torch.int32),
                                     max_pages=6, block_size=32, page_size=16)
    assert n.tolist() == [4, 1] and n.dtype == torch.int32
    assert ids.tolist() == [[10, 11, 4, 5, -1, -1], [8, -1, -1, -1, -1, -1]]


# ---- scores and selection ------------------------------------------------------------

def brute_scores(q, kmin, kmax, ids, num_pages, reduce):
    batch, heads, _ = q.shape
    kvh = kmin.shape[1]
    out = torch.full((batch, kvh, ids.shape[1]), -INF, dtype=torch.float64)
    for b in range(batch):
        for p in range(min(int(num_pages[b]), ids.shape[1])):
            if ids[b, p] < 0:
                continue
            lo, hi = kmin[ids[b, p]].double(), kmax[ids[b, p]].double()
            for h in range(heads):
                qh = q[b, h].double()
                s = torch.maximum(qh * lo[h * kvh // heads], qh * hi[h * kvh // heads]).sum()
                g = h // (heads // kvh)
                prev = out[b, g, p]
                first = h % (heads // kvh) == 0
                out[b, g, p] = s if first else (max(prev, s) if reduce == "max" else prev + s)
    return out


def random_bounds(pages, kvh, dim, seed, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(2, pages, kvh, dim, generator=gen)
    return torch.minimum(a, b).to(dtype), torch.maximum(a, b).to(dtype)


@pytest.mark.parametrize("reduce", ["max", "sum"])
@pytest.mark.parametrize("group", [1, 4])
def test_page_scores_match_formula(reduce, group):
    kmin, kmax = random_bounds(40, 2, 16, seed=group)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(3, 2 * group, 16, generator=gen)
    ids = torch.randint(0, 40, (3, 9), generator=gen)
    ids[1, 2] = -1
    num_pages = torch.tensor([9, 5, 0], dtype=torch.int32)
    got = page_scores_ref(q, kmin, kmax, ids, num_pages, gqa_reduce=reduce)
    want = brute_scores(q, kmin, kmax, ids, num_pages, reduce)
    assert got.dtype == torch.float32 and got.shape == (3, 2, 9)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        page_scores_ref(q, kmin, kmax, ids, num_pages, gqa_reduce="mean")


def brute_select(scores, n, budget, sink, recent):
    if n <= budget:
        return list(range(n))
    keep = set(range(sink)) | set(range(n - recent, n))
    rest = sorted((p for p in range(n) if p not in keep), key=lambda p: -float(scores[p]))
    return sorted(keep | set(rest[:budget - len(keep)]))


@pytest.mark.parametrize("sink,recent", [(1, 1), (2, 3), (0, 1)])
@pytest.mark.parametrize("width", [40, 6])  # 6 < budget: the padded-columns path
def test_select_pages_matches_bruteforce(sink, recent, width):
    gen = torch.Generator().manual_seed(sink * 10 + recent)
    budget = 8
    num_pages = torch.tensor([0, 1, 3, 8, 9, 37, 40], dtype=torch.int32).clamp(max=width)
    scores = torch.randn(7, 3, width, generator=gen)
    scores[5, 1, 4] = -INF  # a real page with a -inf score still outranks padding
    idx, counts = select_pages(scores, num_pages, budget, sink, recent)
    assert idx.shape == (7, 3, budget) and idx.dtype == counts.dtype == torch.int32
    for b in range(7):
        for h in range(3):
            want = brute_select(scores[b, h], int(num_pages[b]), budget, sink, recent)
            c = int(counts[b, h])
            assert c == len(want) and idx[b, h, :c].tolist() == want
            pad = want[-1] if want else 0
            assert idx[b, h, c:].tolist() == [pad] * (budget - c)


def test_select_pages_edge_cases():
    with pytest.raises(ValueError):
        select_pages(torch.zeros(1, 1, 4), torch.tensor([4]), 2, sink_pages=2)
    idx, counts = select_pages(torch.zeros(2, 3, 0), torch.tensor([0, 0]), 4)
    assert idx.shape == (2, 3, 4) and not idx.any() and not counts.any()


def test_planted_needle_is_selected():
    """A key aligned with the query in a middle page wins against random keys."""
    block, page, kvh, dim, n_pages = 32, 16, 2, 64, 64
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        keys = torch.randn(n_pages * page, kvh, dim, generator=gen)
        q = torch.randn(1, kvh * 4, dim, generator=gen)
        needle_page = int(torch.randint(8, 56, (1,), generator=gen))
        head = seed % (kvh * 4)
        keys[needle_page * page + 5, head // 4] = 3.0 * q[0, head]
        tables = torch.randperm(n_pages // 2, generator=gen).view(1, -1).int()
        tok = torch.arange(n_pages * page)
        slots = tables[0, tok // block].long() * block + tok % block
        kmin, kmax = quest.allocate_page_bounds(n_pages // 2, block, kvh, dim,
                                                dtype=torch.bfloat16, device="cpu")
        quest.update_page_bounds(kmin, kmax, keys.bfloat16(), slots)
        lens = torch.tensor([n_pages * page], dtype=torch.int32)
        ids, num = physical_page_ids(tables, lens, max_pages=n_pages, block_size=block)
        idx, counts = select_pages(page_scores_ref(q, kmin, kmax, ids, num), num, 4)
        assert needle_page in idx[0, head // 4, :int(counts[0, head // 4])].tolist()




@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_stored_bounds_pick_what_dequantized_bounds_pick(fp8):
    """An fp8 cache keeps the bounds of its stored keys (value / scale of their KV head):
    each head's scale multiplies all its pages' scores alike, so the picks are those of the
    bounds of the dequantized keys."""
    block, page, kvh, dim, n_pages, budget = 32, 16, 4, 64, 96, 12
    gen = torch.Generator().manual_seed(5)
    scales = torch.tensor([0.02, 0.37, 1.0, 6.5])                 # per KV head, as calibrated
    stored = quantize_ref(torch.randn(n_pages * page, kvh, dim, generator=gen) * 3, scales, fp8)
    q = torch.randn(2, kvh * 2, dim, generator=gen)
    tables = torch.randperm(n_pages // 2, generator=gen).view(1, -1).int().expand(2, -1)
    tok = torch.arange(n_pages * page)
    slots = tables[0, tok // block].long() * block + tok % block
    picks = []
    dequantized = dequantize_ref(stored, scales, torch.float32)
    for keys, dtype in ((stored, fp8), (dequantized, torch.float32)):
        bounds = quest.allocate_page_bounds(n_pages // 2, block, kvh, dim, dtype=dtype, device="cpu")
        quest.update_page_bounds(*bounds, keys, slots)
        picks.append(select_decode_pages_ref(
            q, *bounds, tables, torch.tensor([n_pages * page, 40 * page], dtype=torch.int32),
            max_pages=n_pages, block_size=block, page_size=page, budget_pages=budget).indices)
    assert picks[0].dtype == torch.int32 and torch.equal(picks[0], picks[1])


def test_newest_block_pages_follow_the_selected_ones():
    indices = torch.tensor([[[0, 1, 3, 3], [1, 2, 2, 2]]], dtype=torch.int32)    # B=1, KVH=2
    counts = torch.tensor([[3, 2]], dtype=torch.int32)
    pages, total = with_newest_block(indices, counts, torch.tensor([64]), block_size=32, page_size=16)
    assert total.tolist() == [[5, 4]]
    assert pages[0, 0, :5].tolist() == [0, 1, 3, 4, 5]          # block 2 starts at page 4
    assert pages[0, 1, :4].tolist() == [1, 2, 4, 5]
    assert pages.shape == (1, 2, 6)


# ---- the fused op ----------------------------------------------------------------------

def fused_case(lens, group=2, kvh=2, dim=16, block=32, page=16, seed=0, dtype=torch.float32):
    """Bounds of a random cache, shuffled block tables with garbage past each context."""
    gen = torch.Generator().manual_seed(seed)
    n_blocks = [-(-n // block) + 1 for n in lens]            # + the newest block's
    num_blocks = sum(n_blocks) + 3
    tables = shuffled_tables(n_blocks, num_blocks, gen)
    kmin, kmax = random_bounds(num_blocks * (block // page), kvh, dim, seed, dtype)
    q = torch.randn(len(lens), kvh * group, dim, generator=gen).to(dtype)
    return q, kmin, kmax, tables, torch.tensor(lens, dtype=torch.int32)


def test_fused_reference_is_the_steps_and_counts():
    q, kmin, kmax, tables, lens = fused_case([0, 64, 320, 800], seed=1)
    counters = torch.zeros(2, dtype=torch.int64)
    got = select_decode_pages_ref(q, kmin, kmax, tables, lens, max_pages=50, block_size=32,
                                  page_size=16, budget_pages=6, append_newest=True,
                                  physical=True, counters=counters)
    ids, num = physical_page_ids(tables, lens, max_pages=50, block_size=32)
    picks, counts = select_pages(page_scores_ref(q, kmin, kmax, ids, num), num, 6)
    want = with_newest_block(picks, counts, lens, 32, 16)
    assert torch.equal(got.indices, want[0]) and torch.equal(got.counts, want[1])
    assert counters.tolist() == [int(counts.sum()), 8]
    blocks = tables.long().gather(1, (got.indices.long() // 2).flatten(1)).view_as(got.indices)
    assert torch.equal(got.physical, blocks * 2 + got.indices % 2)
    assert got.counts[0].tolist() == [2, 2]                  # no full block: the newest only
    assert got.indices[2, :, :8].max() < 20 + 2


def test_fused_op_dispatches_and_validates():
    q, kmin, kmax, tables, lens = fused_case([96], seed=2)
    kw = dict(max_pages=8, block_size=32, page_size=16)
    with pytest.raises(ValueError, match="budget_pages"):
        select_decode_pages(q, kmin, kmax, tables, lens, budget_pages=1, **kw)
    with pytest.raises(ValueError, match="gqa_reduce"):
        select_decode_pages(q, kmin, kmax, tables, lens, budget_pages=4, gqa_reduce="mean", **kw)
    got = select_decode_pages(q, kmin, kmax, tables, lens, budget_pages=4, **kw)
    assert got.physical is None and got.counts.tolist() == [[4, 4]]


# ---- Triton kernels vs references (interpreter on CPU, compiled on CUDA) ------------------

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
# (context lens (multiples of the block), group, kv heads, dim, budget, reduce, dtype)
FUSED_CASES = [
    ([0, 32, 96, 640, 2048], 2, 2, 16, 6, "max", f32),
    ([1024, 64], 4, 2, 64, 9, "sum", f32),
    ([4096, 3008], 1, 3, 8, 40, "max", f32),          # head_dim < 16: no tl.dot
    ([1536, 512], 4, 2, 64, 12, "max", f16),          # bf16 where compiled (see below)
    ([40960, 2048], 2, 2, 16, 50, "max", f32),        # rows of several 1,024-page chunks
]


def check_selection(got, want, scores, ties_ok: bool) -> None:
    """Same counts; the same pages, except between pages tied within rounding."""
    assert torch.equal(got.counts, want.counts)
    for b, h in ((b, h) for b in range(got.counts.shape[0]) for h in range(got.counts.shape[1])):
        n = int(got.counts[b, h])
        mine, theirs = set(got.indices[b, h, :n].tolist()), set(want.indices[b, h, :n].tolist())
        assert sorted(mine) == got.indices[b, h, :n].tolist(), "not ascending"
        diff = mine ^ theirs
        if diff:
            assert ties_ok, (b, h, sorted(diff))
            row = scores[b, h]
            kept = min(float(row[p]) for p in mine & theirs) if mine & theirs else INF
            assert all(abs(float(row[p]) - kept) <= 1e-2 * abs(kept) + 1e-3 for p in diff)
        pad = int(got.indices[b, h, n - 1]) if n else 0
        assert got.indices[b, h, n:].tolist() == [pad] * (got.indices.shape[2] - n)
        if got.physical is not None:
            assert torch.equal(got.physical[b, h, :n], want.physical[b, h, :n])


def on_cpu(selection) -> Selection:
    return Selection(*(t.cpu() if t is not None else None for t in selection))


def check_triton_selection(device: str) -> int:
    from astream.ops import triton_quest_select as tqs
    n = 0
    for i, (lens, group, kvh, dim, budget, reduce, dtype) in enumerate(FUSED_CASES * 2):
        in_registers = i < len(FUSED_CASES)      # then the same cases through the long-row path
        # The interpreter's tl.dot mis-reads bfloat16; the engine's dtype is tested compiled.
        dtype = bf16 if dtype == f16 and device == "cuda" else dtype
        for append, physical in ((True, False), (False, True)):
            args = [t.to(device) for t in fused_case(lens, group, kvh, dim, seed=30 + i,
                                                     dtype=dtype)]
            kw = dict(max_pages=max(lens) // 16 + 4, block_size=32, page_size=16,
                      budget_pages=budget, sink_pages=1, recent_pages=2, gqa_reduce=reduce,
                      append_newest=append, physical=physical)
            mine_counters = torch.zeros(2, dtype=torch.int64, device=device)
            want_counters = torch.zeros(2, dtype=torch.int64, device=device)
            got = tqs.select_decode_pages_triton(*args, **kw, counters=mine_counters,
                                                 max_row_in_registers=1 << 14 if in_registers else 0)
            want = select_decode_pages_ref(*args, **kw, counters=want_counters)
            ids, num = physical_page_ids(args[3], args[4], max_pages=kw["max_pages"], block_size=32)
            scores = page_scores_ref(*args[:3], ids, num, gqa_reduce=reduce).cpu()
            got, want = on_cpu(got), on_cpu(want)
            check_selection(got, want, scores, ties_ok=dtype != f32)
            assert torch.equal(mine_counters, want_counters)
            n += 1
    # Equal scores: ties go to the lowest pages, after the forced sink and recent ones.
    q, kmin, kmax, tables, lens = (t.to(device) for t in fused_case([640], seed=9))
    flat = torch.zeros_like(kmin)
    got = tqs.select_decode_pages_triton(
        q, flat, flat, tables, lens, max_pages=40, block_size=32, page_size=16, budget_pages=5,
        sink_pages=1, recent_pages=1, gqa_reduce="max", append_newest=False, physical=False,
        counters=None)
    assert got[0].cpu().tolist() == [[[0, 1, 2, 3, 39]] * 2]
    return (n + 1 + check_triton_ties_and_near_ties(device) + check_triton_bounds(device)
            + check_triton_fp8_bounds_scores(device))


def check_triton_ties_and_near_ties(device: str) -> int:
    """Scores with many exact ties, or differing only in the last mantissa bits, or of
    both signs: the picks are the brute-force top (ties to the lowest page), through every
    step of the bisection, with the row in registers and re-read from memory."""
    from astream.ops import triton_quest_select as tqs
    gen = torch.Generator().manual_seed(11)
    n = 0
    for pages, budget in ((300, 37), (2500, 301)):
        distinct = 1 + torch.randperm(pages, generator=gen).double() * 2.0 ** -21
        # Every value has at most 21 significant bits, so each score (16 * value, a sum of
        # 16 products) is exact in float32 whatever order the kernel adds in.
        signed = (torch.randn(pages, generator=gen).double() * 4096).round() / 4096
        for values in (torch.randint(0, 5, (pages,), generator=gen).double(), distinct,
                       signed, -distinct):
            bounds = values.float().view(pages, 1, 1).expand(pages, 1, 16).contiguous()
            q = torch.ones(1, 1, 16, device=device)       # every score is 16 * value, exactly
            tables = torch.arange(pages // 2, dtype=torch.int32).view(1, -1)
            lens = torch.tensor([pages * 16], dtype=torch.int32)
            args = (q, bounds.to(device), bounds.to(device), tables.to(device), lens.to(device))
            forced = {0, pages - 2, pages - 1}
            rest = sorted(set(range(pages)) - forced, key=lambda p: (-float(values[p]), p))
            want = sorted(forced | set(rest[:budget - len(forced)]))
            for registers in (1 << 14, 0):
                got = tqs.select_decode_pages_triton(
                    *args, max_pages=pages, block_size=32, page_size=16, budget_pages=budget,
                    sink_pages=1, recent_pages=2, gqa_reduce="max", append_newest=False,
                    physical=False, counters=None, max_row_in_registers=registers)
                assert got[0][0, 0].cpu().tolist() == want, (pages, registers)
                n += 1
    return n


def check_triton_bounds(device: str) -> int:
    """The bounds kernel against the reference: prefill runs, decode rows, padding, reuse;
    bounds in the model's dtype, and of fp8 caches' stored keys."""
    from astream.ops import triton_quest_select as tqs
    gen = torch.Generator().manual_seed(4)
    shape = dict(num_blocks=8, block_size=32, kv_heads=2, head_dim=24, page_size=16)
    model_dtype = bf16 if device == "cuda" else f16       # the interpreter truncates to bfloat16
    steps = [list(range(64, 100)) + list(range(160, 165)),       # two prefill runs
             list(range(100, 120)),                               # a chunk from mid-page
             [120, 165, 7 * 32, 7 * 32, 7 * 32],                  # decode rows + padding
             list(range(64, 70))]                                 # a freed block reused
    for dtype in (model_dtype, torch.float8_e4m3fn, torch.float8_e5m2):
        ref = quest.allocate_page_bounds(**shape, dtype=dtype, device="cpu")
        mine = tuple(t.to(device) for t in quest.allocate_page_bounds(**shape, dtype=dtype,
                                                                      device="cpu"))
        for slots in steps:
            keys = (torch.randn(len(slots), 2, 24, generator=gen) * 20).to(dtype)
            slots = torch.tensor(slots)
            quest.update_page_bounds(*ref, keys, slots, 16)
            tqs.update_page_bounds_triton(*mine, keys.to(device), slots.to(device), 16)
            live = slice(0, 7 * 2)              # pages of blocks 0-6: the scratch block 7 may differ
            for got, want in zip(mine, ref):
                assert torch.equal(got.cpu()[live].float(), want[live].float()), dtype
    return 3


def check_triton_fp8_bounds_scores(device: str) -> int:
    """Page scores from fp8 bounds (widened to the query's dtype) and the picks they make."""
    from astream.ops import triton_quest_select as tqs
    q_dtype = bf16 if device == "cuda" else f32
    n = 0
    for i, fp8 in enumerate((torch.float8_e4m3fn, torch.float8_e5m2)):
        q, kmin, kmax, tables, lens = fused_case([1536, 512], group=4, kvh=2, dim=64, seed=60 + i)
        args = [q.to(q_dtype), (kmin * 8).to(fp8), (kmax * 8).to(fp8), tables, lens]
        args = [t.to(device) for t in args]
        kw = dict(max_pages=1536 // 16 + 4, block_size=32, page_size=16, budget_pages=12,
                  sink_pages=1, recent_pages=2, gqa_reduce="max", append_newest=True,
                  physical=True)
        got = on_cpu(tqs.select_decode_pages_triton(*args, **kw, counters=None))
        want = on_cpu(select_decode_pages_ref(*args, **kw))
        ids, num = physical_page_ids(args[3], args[4], max_pages=kw["max_pages"], block_size=32)
        scores = page_scores_ref(*args[:3], ids, num).cpu()
        check_selection(got, want, scores, ties_ok=q_dtype != f32)
        n += 1
    return n


N_TRITON_CASES = 4 * len(FUSED_CASES) + 4 + 16 + 2


def test_register_head_pads_little_and_rereads_little():
    from astream.ops.triton_quest_select import register_head
    assert register_head(8256) == 8192              # 64 pages re-read, not 8,128 lanes padded
    assert register_head(6250) == 8192              # 1,942 padded, not 2,154 re-read
    assert register_head(16000) == 16384 and register_head(40000) == 16384   # the cap
    assert register_head(5) == 16 and register_head(3000, limit=1000) == 512
    assert all(register_head(n) & (register_head(n) - 1) == 0 for n in range(1, 20000, 97))


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the compiled kernels are tested")
def test_triton_selection_interpreter_matches_reference():
    assert run_interpreted_check("test_quest_select", "check_triton_selection") == N_TRITON_CASES


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_selection_on_gpu_matches_reference():
    assert check_triton_selection("cuda") == N_TRITON_CASES
