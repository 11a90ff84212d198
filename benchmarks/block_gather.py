"""The whole-block gather (ops/triton_block_gather.py) reading pinned host memory: GB/s per
launch shape, for one layer of a Qwen3-4B-shaped context (8 KV heads x 128, 256-token
blocks), K and V. Each figure is the median of --reps launches timed with CUDA events; one
large cudaMemcpyAsync of the same bytes is the ceiling.

    python benchmarks/block_gather.py [--tokens 32768] [--dtypes bfloat16,float8_e4m3fn]
"""

from __future__ import annotations

import argparse

import torch

from common import cuda_times_ms, percentile, save  # noqa: I001
from astream.ops.block_gather import packed_block_table
from astream.ops.triton_block_gather import gather_blocks_triton

BLOCK, KV_HEADS, DIM = 256, 8, 128


def median_ms(fn, reps: int) -> float:
    return percentile(cuda_times_ms(fn, reps), 50)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--dtypes", default="bfloat16,float8_e4m3fn")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    blocks = args.tokens // BLOCK
    rows = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        pool = [torch.empty(4 * blocks, KV_HEADS, BLOCK, DIM, dtype=dtype, pin_memory=True)
                for _ in range(2)]
        dst = [torch.empty(blocks, KV_HEADS, BLOCK, DIM, dtype=dtype, device="cuda") for _ in range(2)]
        tables = torch.randperm(4 * blocks)[:blocks].int().view(1, -1).cuda()
        nblocks = torch.tensor([blocks], dtype=torch.int32, device="cuda")
        dst_table = packed_block_table(nblocks, blocks)
        nbytes = 2 * dst[0].numel() * dst[0].element_size()
        copy_ms = median_ms(lambda: [d.copy_(p[:blocks], non_blocking=True) for d, p in zip(dst, pool)],
                            args.reps)
        row = {"dtype": name, "tokens": args.tokens, "MB": round(nbytes / 1e6, 1),
               "one_copy_GBps": round(nbytes / copy_ms / 1e6, 1)}
        for per_sm in (1, 2, 4):
            for chunk in (8192, 16384, 32768):
                for warps in (4, 8):
                    ms = median_ms(lambda: gather_blocks_triton(
                        *pool, tables, nblocks, dst_table, *dst, programs_per_sm=per_sm,
                        chunk_bytes=chunk, num_warps=warps), args.reps)
                    row[f"sm{per_sm}_c{chunk // 1024}k_w{warps}"] = round(nbytes / ms / 1e6, 1)
        best = max((v, k) for k, v in row.items() if k.startswith("sm"))
        print(name, "one copy", row["one_copy_GBps"], "GB/s; best gather", best, flush=True)
        rows.append(row)
    save("block_gather", {"rows": rows})


if __name__ == "__main__":
    main()
