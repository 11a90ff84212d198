"""Whole KV blocks of some rows' contexts, copied from a head-major pool into one packed
buffer, driven by device-side tables (no host decision, so a CUDA graph can hold it).

Row r's first nblocks[r] entries of tables[r] are pool blocks; block j of row r lands at
block dst_table[r, j] of the destination. On CUDA the pool may be pinned host memory,
read in place by the kernel (zero-copy), which is how an offloaded decode step can load a
layer's KV from inside a CUDA graph: a cudaMemcpy node would bake the source in.
"""

from __future__ import annotations

import torch
from torch import Tensor

from astream.ops.attention import select_decode_backend


def packed_block_table(nblocks: Tensor, width: int) -> Tensor:
    """[B, width] int32 destinations packing each row's blocks after the previous rows'
    (row r's block j at sum(nblocks[:r]) + j)."""
    first = torch.cumsum(nblocks, 0, dtype=torch.int32) - nblocks.to(torch.int32)
    return first.unsqueeze(1) + torch.arange(width, dtype=torch.int32, device=nblocks.device)


def gather_blocks_ref(src_k: Tensor, src_v: Tensor, tables: Tensor, nblocks: Tensor,
                      dst_table: Tensor, dst_k: Tensor, dst_v: Tensor) -> None:
    """src [pool blocks, ...] -> dst [blocks, ...] (the same block shape); tables and
    dst_table [B, M], nblocks [B]. Entries j >= nblocks[r] move nothing."""
    width = tables.shape[1]
    keep = torch.arange(width, device=tables.device) < nblocks.unsqueeze(1)
    src = tables[keep].long().to(src_k.device)
    dst = dst_table[keep].long().to(dst_k.device)
    for source, dest in ((src_k, dst_k), (src_v, dst_v)):
        dest[dst] = source[src].to(dest.device)


def gather_blocks(src_k: Tensor, src_v: Tensor, tables: Tensor, nblocks: Tensor,
                  dst_table: Tensor, dst_k: Tensor, dst_v: Tensor) -> None:
    """`gather_blocks_ref`'s contract; on CUDA a Triton kernel, which also reads a pinned
    host pool in place. Every block must be contiguous."""
    if select_decode_backend(dst_k.device) == "triton":
        from astream.ops import triton_block_gather
        triton_block_gather.gather_blocks_triton(src_k, src_v, tables, nblocks, dst_table,
                                                 dst_k, dst_v)
        return
    gather_blocks_ref(src_k, src_v, tables, nblocks, dst_table, dst_k, dst_v)
