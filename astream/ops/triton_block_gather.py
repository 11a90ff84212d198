"""Triton kernel of `ops.block_gather` (CUDA; also runs under TRITON_INTERPRET=1).

A fixed number of programs (one per SM) walks the work items (row, block of the row,
CHUNK-byte piece of the block), each moving its piece of K and of V; entries past a row's
nblocks are skipped. One program per SM keeps about 2 MB of PCIe reads in flight, enough
for the link (docs/BENCHMARKS.md: 50 GB/s for a kernel, 54.5 for one large copy), while
leaving the SMs to the layer computing beside it: a grid of one program per piece filled
the GPU and held the compute stream back until the gather was done.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

CHUNK_BYTES = 16384
NUM_WARPS = 4
PROGRAMS_PER_SM = 1
DEFAULT_PROGRAMS = 4     # off CUDA (the interpreter)


@triton.jit
def _gather_blocks_kernel(
    src_k, src_v, dst_k, dst_v, tables_ptr, nblocks_ptr, dst_table_ptr,
    stride_tb, stride_db, src_kb, src_vb, dst_kb, dst_vb, block_bytes, width, pieces, items,
    CHUNK: tl.constexpr,
):
    lanes = tl.arange(0, CHUNK)
    for item in range(tl.program_id(0), items, tl.num_programs(0)):
        r = item // (width * pieces)
        j = (item // pieces) % width
        if j < tl.load(nblocks_ptr + r):
            src = tl.load(tables_ptr + r * stride_tb + j).to(tl.int64)
            dst = tl.load(dst_table_ptr + r * stride_db + j).to(tl.int64)
            offs = (item % pieces) * CHUNK + lanes
            mask = offs < block_bytes
            # Both loads before either store: two reads in flight, not one.
            k = tl.load(src_k + src * src_kb + offs, mask=mask)
            v = tl.load(src_v + src * src_vb + offs, mask=mask)
            tl.store(dst_k + dst * dst_kb + offs, k, mask=mask)
            tl.store(dst_v + dst * dst_vb + offs, v, mask=mask)


def _bytes(x: Tensor) -> Tensor:
    """[blocks, ...] as [blocks, block bytes] uint8; each block must be contiguous."""
    flat = x.flatten(1)
    if flat.stride(1) != 1:
        raise ValueError("gather_blocks needs contiguous blocks")
    return flat.view(torch.uint8)


def gather_blocks_triton(src_k: Tensor, src_v: Tensor, tables: Tensor, nblocks: Tensor,
                         dst_table: Tensor, dst_k: Tensor, dst_v: Tensor, *,
                         programs_per_sm: int = PROGRAMS_PER_SM, chunk_bytes: int = CHUNK_BYTES,
                         num_warps: int = NUM_WARPS) -> None:
    """See astream.ops.block_gather.gather_blocks_ref; src may be pinned host memory.
    (The keywords are for benchmarks/block_gather.py.)"""
    rows, width = tables.shape
    if rows == 0 or width == 0:
        return
    sk, sv, dk, dv = (_bytes(x) for x in (src_k, src_v, dst_k, dst_v))
    block_bytes = sk.shape[1]
    if not (sv.shape[1] == dk.shape[1] == dv.shape[1] == block_bytes):
        raise ValueError("source and destination blocks differ in size")
    tables = tables if tables.stride(1) == 1 else tables.contiguous()
    dst_table = dst_table if dst_table.stride(1) == 1 else dst_table.contiguous()
    chunk = min(chunk_bytes, triton.next_power_of_2(block_bytes))
    pieces = triton.cdiv(block_bytes, chunk)
    items = rows * width * pieces
    _gather_blocks_kernel[(min(items, programs_per_sm * _sm_count(dk.device)),)](
        sk, sv, dk, dv, tables, nblocks, dst_table, tables.stride(0), dst_table.stride(0),
        sk.stride(0), sv.stride(0), dk.stride(0), dv.stride(0), block_bytes, width, pieces,
        items, CHUNK=chunk, num_warps=num_warps,
    )


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count
