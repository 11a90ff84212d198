"""The Quest page gather (astream.ops.pages.gather_pages): the torch reference against brute
force and the offload flow, and the Triton kernel against the reference (interpreter on the
CPU, compiled and reading pinned host memory in place on CUDA)."""

from __future__ import annotations

import itertools

import pytest
import torch
from triton_interpreter import run_interpreted_check

from astream.ops import pages as page_ops
from astream.ops.quest_select import physical_page_ids, select_pages

def gather_case(seed, batch=2, kvh=2, n_sel=5, block=32, page=16, dim=64, dst_slots=None):
    """A head-major pool (a strided view of a bigger one), picks, counts and filled dsts
    (of dst_slots pages, default n_sel)."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(3, 2, 9, kvh, block, dim, generator=gen)[1]
    page_src = torch.randint(0, 9 * block // page, (batch, kvh, n_sel), generator=gen)
    counts = torch.randint(0, n_sel + 1, (batch, kvh), generator=gen).int()
    counts[0, 0] = n_sel
    page_src[1, 1, -1] = -1  # garbage past counts is never read
    counts[1, 1] = n_sel - 1
    dst = torch.full((2, batch, kvh, (dst_slots or n_sel) * page, dim), 7.0)
    return pool[0], pool[1], page_src, dst[0], dst[1], counts


def test_gather_reference_copies_selected_pages():
    src_k, src_v, page_src, dst_k, dst_v, counts = gather_case(0)
    page_ops.gather_pages(src_k, src_v, page_src, dst_k, dst_v, counts)
    for b, h, j in itertools.product(*map(range, page_src.shape)):
        got = dst_k[b, h, j * 16:(j + 1) * 16], dst_v[b, h, j * 16:(j + 1) * 16]
        if j >= counts[b, h]:
            assert torch.all(got[0] == 7) and torch.all(got[1] == 7)
            continue
        blk, sub = divmod(int(page_src[b, h, j]), 2)
        assert torch.equal(got[0], src_k[blk, h, sub * 16:(sub + 1) * 16])
        assert torch.equal(got[1], src_v[blk, h, sub * 16:(sub + 1) * 16])



def destination_pages(seed: int, page_src: torch.Tensor, slots: int | None = None) -> torch.Tensor:
    """Per (row, head) distinct destination pages among `slots` (default: as many as picks),
    about a third of them -1."""
    gen = torch.Generator().manual_seed(seed)
    batch, kvh, n_sel = page_src.shape
    perm = torch.argsort(torch.rand(batch, kvh, slots or n_sel, generator=gen), dim=-1)[..., :n_sel]
    return torch.where(torch.rand(batch, kvh, n_sel, generator=gen) < 0.35, -1, perm)


@pytest.mark.parametrize("slots", [None, 9])
def test_gather_to_destination_pages_copies_only_those_with_one(slots):
    """Into a buffer of as many pages as picks, or of more (a prefetch's page buffer)."""
    src_k, src_v, page_src, dst_k, dst_v, counts = gather_case(5, dst_slots=slots)
    dst_pages = destination_pages(5, page_src, slots)
    page_ops.gather_pages(src_k, src_v, page_src, dst_k, dst_v, counts, dst_pages=dst_pages,
                          page_size=16)
    for b, h in itertools.product(*map(range, page_src.shape[:2])):
        written = {}
        for j in range(int(counts[b, h])):
            if dst_pages[b, h, j] >= 0:
                written[int(dst_pages[b, h, j])] = divmod(int(page_src[b, h, j]), 2)
        for slot in range(slots or page_src.shape[2]):
            got = dst_k[b, h, slot * 16:(slot + 1) * 16], dst_v[b, h, slot * 16:(slot + 1) * 16]
            if slot not in written:
                assert torch.all(got[0] == 7) and torch.all(got[1] == 7)
                continue
            blk, sub = written[slot]
            assert torch.equal(got[0], src_k[blk, h, sub * 16:(sub + 1) * 16])
            assert torch.equal(got[1], src_v[blk, h, sub * 16:(sub + 1) * 16])


def test_gathered_pages_attend_like_the_paged_cache():
    """Offload flow: gather host pages into a dense buffer, attend it as a one-block-per-
    sequence cache (arbitrary strides), and get the selected-pages result of the pool."""
    gen = torch.Generator().manual_seed(3)
    kvh, block, page, dim, n_sel = 2, 32, 16, 16, 3
    pool = torch.randn(2, 12, kvh, block, dim, generator=gen)  # head-major, like the host pool
    tables = torch.randperm(12, generator=gen)[:8].view(2, 4).int()
    lens = torch.tensor([128, 96], dtype=torch.int32)  # host pages are full pages
    q = torch.randn(2, kvh * 2, dim, generator=gen)
    ids, num = physical_page_ids(tables, lens, max_pages=8, block_size=block)
    pages, counts = select_pages(torch.randn(2, kvh, 8, generator=gen), num, n_sel)
    counts[1, 1] = 2
    dst = torch.zeros(2, 2, kvh, n_sel * page, dim)
    page_ops.gather_pages(pool[0], pool[1], ids.gather(1, pages.long().flatten(1)).view(pages.shape),
                       dst[0], dst[1], counts)
    dense = dst.transpose(2, 3)  # [B, n_sel * page, KVH, D]: "block" b is sequence b's buffer
    out, lse = page_ops.paged_decode_selected(
        q, dense[0], dense[1], torch.arange(2, dtype=torch.int32).view(2, 1),
        torch.arange(n_sel, dtype=torch.int32).expand(2, kvh, n_sel), counts,
        torch.full((2,), n_sel * page, dtype=torch.int32), page_size=page, scale=0.25)
    want = page_ops.paged_decode_selected(q, pool[0].transpose(1, 2), pool[1].transpose(1, 2),
                                       tables, pages, counts, lens, page_size=page, scale=0.25)
    torch.testing.assert_close(out, want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want[1], atol=1e-5, rtol=1e-5)


# ---- Triton kernel vs reference ------------------------------------------------------

# seed, counts, fp8, dst pages, destination slots (None: as many as picks; more: a page buffer
# that holds more pages than one selection, as Quest's prefetch keeps)
GATHER_CASES = ((0, True, False, False, None), (1, False, False, False, None),
                (2, True, True, False, None), (3, True, False, True, None),
                (4, False, True, True, None), (5, True, False, True, 8), (6, True, True, True, 13))


def check_triton_gather(device: str) -> int:
    """The gather kernel against the reference, bit for bit, with a program a page and with
    three programs walking the pages four at a time; returns the cases checked."""
    from astream.ops import triton_pages
    n = 0
    for (seed, with_counts, fp8, to_pages, slots), (programs, at_once) in itertools.product(
            GATHER_CASES, ((None, 1), (3, 4))):
        src_k, src_v, page_src, dst_k, dst_v, counts = gather_case(seed, dst_slots=slots)
        dst_pages = destination_pages(seed, page_src, slots) if to_pages else None
        page_size = 16 if slots else None
        if fp8:     # the host pool of an fp8 cache: bytes move as they are
            src_k, src_v, dst_k, dst_v = (t.to(torch.float8_e4m3fn) for t in (src_k, src_v, dst_k, dst_v))
        counts = counts if with_counts else None
        page_src = page_src.clamp(min=0)
        want_k, want_v = dst_k.clone(), dst_v.clone()
        page_ops.gather_pages_ref(src_k, src_v, page_src, want_k, want_v, counts, dst_pages, page_size)
        dst_k, dst_v = dst_k.to(device), dst_v.to(device)
        counts = counts.to(device) if with_counts else None
        dst_pages = dst_pages.to(device) if to_pages else None
        if device == "cuda":        # the engine's host pool is pinned: read in place, zero-copy
            src_k, src_v = src_k.pin_memory(), src_v.pin_memory()
        triton_pages.gather_pages_triton(src_k, src_v, page_src.to(device), dst_k, dst_v, counts,
                                         dst_pages, page_size, programs=programs,
                                         pages_at_once=at_once)
        assert torch.equal(dst_k.cpu().view(torch.uint8), want_k.view(torch.uint8))
        assert torch.equal(dst_v.cpu().view(torch.uint8), want_v.view(torch.uint8))
        n += 1
    return n


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the compiled kernel is tested")
def test_triton_gather_interpreter_matches_reference():
    assert run_interpreted_check("test_quest_gather", "check_triton_gather") == 2 * len(GATHER_CASES)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_gather_on_gpu_matches_reference():
    assert check_triton_gather("cuda") == 2 * len(GATHER_CASES)
