"""Quest's page selection on the GPU, per warp count of the select kernel, and with half
the register head it picks (the rest of the row re-read from L2 on every step).

One call scores every page of a Qwen3-4B-shaped layer (8 KV heads, 4 query heads each,
head dim 128, bf16 bounds) and picks the pages of the budget. Each variant is replayed from
a CUDA graph of 20 calls, so the figure is GPU time, not launch time; it also checks that
every variant picks the same pages. Medians of --reps replays, microseconds per call.

    python benchmarks/quest_select_sweep.py [--contexts 32768,131072] [--batches 1,4]
"""

from __future__ import annotations

import argparse
from typing import Iterator

import torch

from common import cuda_times_ms, save  # noqa: I001
from astream.ops import triton_quest_select as tqs

BLOCK, PAGE, KV_HEADS, GROUP, DIM = 256, 16, 8, 4, 128


def inputs(context: int, batch: int, seed: int) -> tuple:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = -(-context // BLOCK) + 1
    pages = batch * blocks * (BLOCK // PAGE)
    center = torch.randn(pages, KV_HEADS, DIM, generator=gen, device="cuda")
    spread = torch.rand(pages, KV_HEADS, DIM, generator=gen, device="cuda")
    kmin, kmax = (center - spread).bfloat16(), (center + spread).bfloat16()
    tables = torch.randperm(batch * blocks, generator=gen, device="cuda").view(batch, blocks).int()
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, KV_HEADS * GROUP, DIM, generator=gen, device="cuda").bfloat16()
    return q, kmin, kmax, tables, lens


def cases(args) -> Iterator[tuple[int, int, tuple, int]]:
    """(context, batch, inputs, max pages of a row) for each case of --contexts x --batches."""
    for context in map(int, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            max_pages = -(-context // BLOCK) * (BLOCK // PAGE) + BLOCK // PAGE
            yield context, batch, inputs(context, batch, seed=context + batch), max_pages


def call(args, budget_pages: int, max_pages: int, warps: int | None,
         head_limit: int = tqs.MAX_ROW_IN_REGISTERS):
    return tqs.select_decode_pages_triton(
        *args, max_pages=max_pages, block_size=BLOCK, page_size=PAGE, budget_pages=budget_pages,
        sink_pages=1, recent_pages=2, gqa_reduce="max", append_newest=True, physical=True,
        counters=None, select_warps=warps, max_row_in_registers=head_limit)


def time_graph(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    times = [ms * 1e3 / 20 for ms in cuda_times_ms(graph.replay, reps)]
    return round(sorted(times)[len(times) // 2], 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    # whole blocks; 99,840 and 199,936 tokens are rows between two powers of two
    parser.add_argument("--contexts", default="32768,99840,131072,199936")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    rows = []
    for context, batch, data, max_pages in cases(args):
        budget = args.budget // PAGE
        picked = {}
        head = tqs.register_head(max_pages - BLOCK // PAGE)
        row = {"context": context, "batch": batch, "budget_pages": budget, "head": head}
        variants = {f"warps{w}": (w, head) for w in (4, 8, 16)}
        variants["half_head"] = (None, head // 2)
        for name, (warps, limit) in variants.items():
            picked[name] = call(data, budget, max_pages, warps, limit)[0].clone()
            row[name + "_us"] = time_graph(lambda: call(data, budget, max_pages, warps, limit),
                                           args.reps)
        first = next(iter(picked.values()))
        row["same_pages"] = all(torch.equal(first, other) for other in picked.values())
        print(row, flush=True)
        rows.append(row)
    save("quest_select_sweep", {"rows": rows})


if __name__ == "__main__":
    main()
