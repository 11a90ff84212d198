"""Whole-block gathers from a (host) pool into a packed buffer: the torch reference against
a plain loop, the Triton kernel against the reference (interpreted on the CPU, compiled and
reading pinned host memory on a GPU)."""

from __future__ import annotations

import pytest
import torch

from astream.ops.block_gather import gather_blocks_ref, packed_block_table
from tests.triton_interpreter import run_interpreted_check

# (rows' block counts, table width, dtype): empty rows, a full row, fp8 bytes.
CASES = [([3, 0, 5], 6, torch.bfloat16), ([1], 4, torch.float32), ([0, 0], 3, torch.float16),
         ([4, 2, 1, 3], 5, torch.float8_e4m3fn)]


def case(counts: list[int], width: int, dtype, seed: int, pool_device="cpu", pin=False):
    gen = torch.Generator().manual_seed(seed)
    pool_blocks, shape = 24, (2, 4, 8)                      # [kv_heads, block_size, head_dim]
    src = [torch.randn(pool_blocks, *shape, generator=gen).to(dtype) for _ in range(2)]
    if pin:
        src = [s.pin_memory() for s in src]
    src = [s.to(pool_device) for s in src] if not pin else src
    tables = torch.stack([torch.randperm(pool_blocks, generator=gen)[:width] for _ in counts]).int()
    tables[tables == 7] = 23            # some garbage past the counts is fine: never read
    nblocks = torch.tensor(counts, dtype=torch.int32)
    return src, tables, nblocks


def expected(src, tables, nblocks, dst_table, total):
    out = [torch.zeros(total, *src[0].shape[1:], dtype=src[0].dtype) for _ in range(2)]
    for r, n in enumerate(nblocks.tolist()):
        for j in range(n):
            for s, o in zip(src, out):
                o[dst_table[r, j]] = s[tables[r, j]].cpu()
    return out


def test_packed_table_puts_rows_one_after_another():
    assert packed_block_table(torch.tensor([2, 0, 3]), 3).tolist() == [[0, 1, 2], [2, 3, 4],
                                                                       [2, 3, 4]]


@pytest.mark.parametrize("counts,width,dtype", CASES)
def test_reference_gathers_each_rows_blocks_in_order(counts, width, dtype):
    src, tables, nblocks = case(counts, width, dtype, seed=len(counts))
    dst_table = packed_block_table(nblocks, width)
    total = max(sum(counts), 1) + 2
    dst = [torch.full((total, *src[0].shape[1:]), 3.0).to(dtype) for _ in range(2)]
    gather_blocks_ref(*src, tables, nblocks, dst_table, *dst)
    want = expected(src, tables, nblocks, dst_table, total)
    for got, ref in zip(dst, want):
        n = sum(counts)
        assert torch.equal(got[:n].view(torch.uint8), ref[:n].view(torch.uint8))
        assert (got[n:].float() == 3.0).all()               # nothing past the packed blocks


def check_triton_gather(device: str) -> int:
    from astream.ops import triton_block_gather
    n = 0
    for i, (counts, width, dtype) in enumerate(CASES):
        pin = device == "cuda"
        src, tables, nblocks = case(counts, width, dtype, seed=100 + i, pin=pin)
        dst_table = packed_block_table(nblocks, width)
        total = max(sum(counts), 1)
        dst = [torch.zeros(total, *src[0].shape[1:], dtype=dtype, device=device) for _ in range(2)]
        triton_block_gather.gather_blocks_triton(*src, tables.to(device), nblocks.to(device),
                                                 dst_table.to(device), *dst)
        want = expected(src, tables, nblocks, dst_table, total)
        for got, ref in zip(dst, want):
            assert torch.equal(got.cpu().view(torch.uint8), ref.view(torch.uint8)), (counts, dtype)
        n += 1
    return n


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the compiled kernel is tested")
def test_triton_gather_interpreted_matches_reference():
    assert run_interpreted_check("test_block_gather", "check_triton_gather") == len(CASES)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_gather_reads_pinned_host_memory_on_gpu():
    assert check_triton_gather("cuda") == len(CASES)
