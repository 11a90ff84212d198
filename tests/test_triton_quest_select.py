"""Quest's Triton kernels against the torch references: page scores and selection (rows in
registers and re-read, ties and near-ties, every group reduction), the bounds update (model
dtype and fp8), and scores from fp8 bounds. In the interpreter on the CPU (in a subprocess),
compiled on CUDA. The two-level selection with its first level in the kernels: on CUDA."""

from __future__ import annotations

import pytest
import torch
from test_quest_select import fused_case
from triton_interpreter import run_interpreted_check

from astream.ops import quest
from astream.ops.quest_select import (
    Selection, page_scores_ref, physical_page_ids, select_decode_pages_grouped,
    select_decode_pages_ref,
)

INF = float("inf")

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
# (context lens (multiples of the block), group, kv heads, dim, budget, reduce, dtype)
FUSED_CASES = [
    ([0, 32, 96, 640, 2048], 2, 2, 16, 6, "max", f32),
    ([1024, 64], 4, 2, 64, 9, "sum", f32),
    ([4096, 3008], 1, 3, 8, 40, "max", f32),          # head_dim < 16: no tl.dot
    ([1536, 512], 4, 2, 64, 12, "max", f16),          # bf16 where compiled (see below)
    ([40960, 2048], 2, 2, 16, 50, "max", f32),        # rows of several 1,024-page chunks
    # "relative": each query head's row written (Qwen2.5's group of 7 padded to 16), then
    # reduced by the reference's torch
    ([0, 32, 96, 640, 2048], 7, 2, 64, 6, "relative", f32),
    ([1536, 512], 4, 2, 64, 12, "relative", f16),
    ([4096, 3008], 3, 3, 8, 40, "relative", f32),
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
    bounds in the model's dtype, and of fp8 caches' stored keys; pages of 16 tokens, and
    of 32 (a group of two pages: more rows than one pass of the kernel takes)."""
    from astream.ops import triton_quest_select as tqs
    gen = torch.Generator().manual_seed(4)
    model_dtype = bf16 if device == "cuda" else f16       # the interpreter truncates to bfloat16
    steps = [list(range(64, 100)) + list(range(160, 165)),       # two prefill runs
             list(range(100, 120)),                               # a chunk from mid-page
             [120, 165, 7 * 32, 7 * 32, 7 * 32],                  # decode rows + padding
             list(range(64, 70))]                                 # a freed block reused
    n = 0
    for page in (16, 32):
        shape = dict(num_blocks=8, block_size=32, kv_heads=2, head_dim=24, page_size=page)
        for dtype in (model_dtype, torch.float8_e4m3fn, torch.float8_e5m2):
            ref = quest.allocate_page_bounds(**shape, dtype=dtype, device="cpu")
            mine = tuple(t.to(device) for t in quest.allocate_page_bounds(**shape, dtype=dtype,
                                                                          device="cpu"))
            for slots in steps:
                keys = (torch.randn(len(slots), 2, 24, generator=gen) * 20).to(dtype)
                slots = torch.tensor(slots)
                quest.update_page_bounds(*ref, keys, slots, page)
                tqs.update_page_bounds_triton(*mine, keys.to(device), slots.to(device), page)
                live = slice(0, 7 * 32 // page)   # pages of blocks 0-6: the scratch block may differ
                for got, want in zip(mine, ref):
                    assert torch.equal(got.cpu()[live].float(), want[live].float()), (page, dtype)
            n += 1
    return n


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
        scores = page_scores_ref(*args[:3], ids, num, gqa_reduce="max").cpu()
        check_selection(got, want, scores, ties_ok=q_dtype != f32)
        n += 1
    return n


N_TRITON_CASES = 4 * len(FUSED_CASES) + 1 + 6 + 16 + 2


def check_triton_grouped(device: str) -> int:
    """The two-level selection, its first level in the kernels, under every reduction:
    groups that cover the context pick what one level picks; fewer groups pick what the
    reference's two levels pick. Qwen2.5's group of 7 query heads; block 0 holds no
    sequence's keys and bounds wider than any page's, as another sequence's block may."""
    from test_quest_groups import BLOCK, PAGE, group_bounds, without_block_zero
    n = 0
    for i, reduce in enumerate(quest.GQA_REDUCTIONS):
        case = without_block_zero(*fused_case([3008, 1600, 320], group=7, kvh=2, dim=64,
                                              block=BLOCK, page=PAGE, seed=80 + i))
        groups = group_bounds(case[1], case[2], 4)
        kw = dict(max_pages=3008 // PAGE + BLOCK // PAGE, block_size=BLOCK, page_size=PAGE,
                  budget_pages=10, sink_pages=1, recent_pages=2, gqa_reduce=reduce,
                  append_newest=True, physical=True)
        for factor in (64, 1):
            args = (*case[:3], *groups, *case[3:])
            got = on_cpu(select_decode_pages_grouped(*(t.to(device) for t in args), group_pages=4,
                                                     group_factor=factor, **kw))
            want = (select_decode_pages_ref(*case, **kw) if factor == 64 else
                    select_decode_pages_grouped(*args, group_pages=4, group_factor=factor, **kw))
            check_selection(got, want, None, ties_ok=False)
            n += 1
    return n


def test_register_head_pads_little_and_rereads_little():
    from astream.ops.triton_quest_select import register_head
    assert register_head(8256) == 8192              # 64 pages re-read, not 8,128 lanes padded
    assert register_head(6250) == 8192              # 1,942 padded, not 2,154 re-read
    assert register_head(16000) == 16384 and register_head(40000) == 16384   # the cap
    assert register_head(5) == 16 and register_head(3000, limit=1000) == 512
    assert all(register_head(n) & (register_head(n) - 1) == 0 for n in range(1, 20000, 97))


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the compiled kernels are tested")
def test_triton_selection_interpreter_matches_reference():
    assert run_interpreted_check("test_triton_quest_select", "check_triton_selection") == N_TRITON_CASES


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_selection_on_gpu_matches_reference():
    assert check_triton_selection("cuda") == N_TRITON_CASES


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_grouped_selection_on_gpu_matches_reference():
    assert check_triton_grouped("cuda") == 2 * len(quest.GQA_REDUCTIONS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("reduce", ["max", "relative"])
# One level; one level at its limit under a plan for two; two levels.
@pytest.mark.parametrize("context", [131072, 262144, 393216])
def test_a_selection_allocates_no_more_than_the_memory_plan_reserves(reduce, context):
    """What a decode step's selection allocates on the GPU beyond its outputs stays within
    QuestPolicy.decode_scratch_bytes, in one level and in two: the bound runtime's own
    select_decode, as the executor calls it."""
    from astream.policies import QuestPolicy
    from astream.policies.base import DecodeQuery, KVLayout
    policy = QuestPolicy(gqa_reduce=reduce, dense_layers=0)
    heads, kv_heads, dim, rows, block = 32, 8, 128, 4, 256
    planned_context = max(context, 393216 if context == 262144 else 0)
    per_row = -(-context // block)
    blocks = rows * per_row + 1
    layout = KVLayout(1, heads, kv_heads, dim, blocks, block, bf16, torch.device("cuda"), False,
                      bf16, max_num_seqs=rows)
    runtime = policy.bind(layout)
    gen = torch.Generator(device="cuda").manual_seed(context)
    keys = torch.randn(blocks * block, kv_heads, dim, device="cuda", generator=gen).to(bf16)
    runtime.on_kv_written(0, keys, torch.arange(blocks * block, device="cuda"))
    del keys
    query = DecodeQuery(
        q=torch.randn(rows, heads, dim, device="cuda", generator=gen).to(bf16),
        block_tables=torch.arange(rows * per_row, device="cuda", dtype=torch.int32).view(rows, per_row),
        context_lens=torch.full((rows,), per_row * block - block, device="cuda", dtype=torch.int32),
        max_context=context, append_newest=True, physical=True)
    for _ in range(2):                                       # the second call: Triton compiled
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        chosen = runtime.select_decode(0, query)
        torch.cuda.synchronize()
        # What stays allocated is the outputs, as the allocator holds them (in 512-byte steps).
        outputs = torch.cuda.memory_allocated() - before
        scratch = torch.cuda.max_memory_allocated() - before - outputs
        del chosen
    planned = policy.decode_scratch_bytes(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                                          rows=rows, max_context=planned_context, block_size=block)
    assert 0 < scratch <= planned, (scratch, planned)
