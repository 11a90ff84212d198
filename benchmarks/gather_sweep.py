"""The offload page gather per kernel shape: pages a program and warps, bf16 and fp8.

One call copies a decode layer's selected pages (Qwen3-4B shape: 8 KV heads, head dim 128,
page 16; budget 4K = 256 pages plus the 16 of the newest block's width) from a pinned,
head-major host pool read in place (zero-copy) into dense device buffers. Each variant
is replayed from a CUDA graph of 20 calls, so the figure is the copy, not the launch;
every variant must copy exactly what the torch reference copies. Medians of --reps.

    python benchmarks/gather_sweep.py [--batches 1,4] [--pages 272]
"""

from __future__ import annotations

import argparse

import torch

from common import cuda_times_ms, save  # noqa: I001
from astream.ops import quest, triton_quest
from astream.runtime.pinned import PinnedHostTensor

KV_HEADS, DIM, PAGE, HOST_BLOCK, HOST_BLOCKS = 8, 128, 16, 256, 600
VARIANTS = [(pages, warps) for pages in (1, 2, 4, 8) for warps in (1, 2, 4, 8)]


def time_graph(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    times = sorted(ms * 1e3 / 20 for ms in cuda_times_ms(graph.replay, reps))
    return times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--pages", type=int, default=272)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        shape = (2, HOST_BLOCKS, KV_HEADS, HOST_BLOCK, DIM)
        pool = PinnedHostTensor(shape, dtype, pin=True)
        raw = pool.tensor.view(torch.uint8)         # any bytes: the copy is compared bytewise
        raw.copy_(torch.randint(0, 120, raw.shape, dtype=torch.uint8))
        for batch in map(int, args.batches.split(",")):
            n_pages = HOST_BLOCKS * HOST_BLOCK // PAGE
            page_src = torch.randint(0, n_pages, (batch, KV_HEADS, args.pages), device="cuda",
                                     generator=gen)
            counts = torch.full((batch, KV_HEADS), args.pages - 16, dtype=torch.int32, device="cuda")
            dst = torch.zeros(2, batch, KV_HEADS, args.pages * PAGE, DIM, dtype=dtype, device="cuda")
            want = torch.zeros_like(dst)
            device_pool = pool.tensor.to("cuda")
            quest.gather_pages_ref(device_pool[0], device_pool[1], page_src, *want, counts)
            del device_pool
            moved = 2 * batch * KV_HEADS * (args.pages - 16) * PAGE * DIM * dst.element_size()
            row = {"kv": str(dtype).removeprefix("torch."), "batch": batch, "pages": args.pages - 16,
                   "MB": round(moved / 1e6, 1)}
            for pages, warps in VARIANTS:
                def call(pages=pages, warps=warps):
                    triton_quest.gather_pages_triton(pool.tensor[0], pool.tensor[1], page_src, *dst,
                                                     counts, pages_per_program=pages, num_warps=warps)
                dst.zero_()
                call()
                exact = torch.equal(dst.view(torch.uint8), want.view(torch.uint8))
                us = time_graph(call, args.reps)
                row[f"p{pages}w{warps}"] = (round(us, 1), round(moved / us / 1e3, 1), exact)
            print(row, flush=True)
            rows.append(row)
        pool.release()
    save("gather_sweep", {"variants": "p<pages a program>w<warps>: (us, GB/s, exact)", "rows": rows})


if __name__ == "__main__":
    main()
