"""Experiment: does prefetching the next GEMM's weight into L2, on a side stream while
Quest's selection runs, shorten a resident sparse layer?

Quest's select kernel is latency bound: at batch 1 it keeps 8 SMs busy for ~18 us and
leaves HBM idle. The o_proj GEMM that follows reads its 21 MB weight (Qwen3-4B) from HBM.
One iteration here is one sparse layer's tail, each on its own copy of the data so L2
starts cold: page scores + selection (the engine's kernels, 128K x 1, budget 4K), a
16.8 MB read standing in for the selected-pages attention, o_proj, and the 100 MB
gate_up GEMM. Variants fork a side stream that reads o_proj's weight once (so it sits in
L2) from just before the select kernel, or from just before the attention stand-in, and
join it before o_proj. All replayed from CUDA graphs; medians of --reps, us an iteration.

    python benchmarks/l2_prefetch.py [--copies 6] [--reps 30]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from common import cuda_times_ms, save  # noqa: I001
from astream.ops import triton_quest_select as tqs
from quest import PAGE, SWEEP_BLOCK as BLOCK, sweep_inputs as inputs

HIDDEN, Q_DIM, INTER = 2560, 4096, 9728


@triton.jit
def _read_kernel(ptr, n, sink_ptr, BLOCK_N: tl.constexpr, EVICT: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK_N
    acc = tl.zeros([BLOCK_N], tl.int32)
    for start in range(pid * BLOCK_N, n, step):
        offs = start + tl.arange(0, BLOCK_N)
        acc ^= tl.load(ptr + offs, mask=offs < n, other=0, eviction_policy=EVICT)
    tl.store(sink_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def _bulk_prefetch_kernel(ptr, n_chunks, sink_ptr, CHUNK_BYTES: tl.constexpr, PER: tl.constexpr):
    pid = tl.program_id(0)
    idx = pid * PER + tl.arange(0, PER)
    ptrs = ptr + idx.to(tl.int64) * CHUNK_BYTES
    ok = idx < n_chunks
    done = tl.inline_asm_elementwise(
        f"{{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], "
        f"{CHUNK_BYTES}; mov.u32 $0, 0; }}",
        "=r,l,r", [ptrs, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(sink_ptr + pid, tl.sum(done, axis=0))


def prefetch(weight: torch.Tensor, sink: torch.Tensor, how: str, programs: int) -> None:
    words = weight.view(torch.int32).view(-1)
    if how == "bulk":
        chunk = 32768
        n_chunks = words.numel() * 4 // chunk
        per = 16
        _bulk_prefetch_kernel[(triton.cdiv(n_chunks, per),)](words, n_chunks, sink,
                                                              CHUNK_BYTES=chunk, PER=per,
                                                              num_warps=1)
    else:
        _read_kernel[(programs,)](words, words.numel(), sink, BLOCK_N=2048,
                                  EVICT="evict_last" if how == "evict_last" else "",
                                  num_warps=4)


class ForkBeforeSelect:
    """Stands in for tqs._select_kernel: launches the prefetch on a side stream, then the
    real select kernel, so the prefetch overlaps selection and not the page scores."""

    def __init__(self, kernel, side: torch.cuda.Stream):
        self.kernel, self.side, self.job = kernel, side, None

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            if self.job is not None:
                self.side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.side):
                    self.job()
            return launch(*args, **kwargs)
        return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--copies", type=int, default=6)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--budget", type=int, default=4096)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = []
    for c in range(args.copies):
        data = inputs(args.context, 1, seed=c)
        w_o = torch.randn(HIDDEN, Q_DIM, generator=gen, device="cuda").bfloat16() * 0.02
        kv = torch.randn(args.budget * 8 * 2, 128, generator=gen, device="cuda").bfloat16()
        layers.append((data, w_o, kv))
    w_gu = torch.randn(2 * INTER, HIDDEN, generator=gen, device="cuda").bfloat16() * 0.02
    x = torch.randn(1, Q_DIM, generator=gen, device="cuda").bfloat16()
    sink = torch.zeros(1024, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    max_pages = -(-args.context // BLOCK) * (BLOCK // PAGE) + BLOCK // PAGE
    real_select = tqs._select_kernel
    fork = ForkBeforeSelect(real_select, side)

    def layer(data, w_o, kv, where: str, how: str, programs: int):
        job = (lambda: prefetch(w_o, sink, how, programs)) if where != "none" else None
        fork.job = job if where == "select" else None
        tqs._select_kernel = fork
        try:
            tqs.select_decode_pages_triton(
                *data, max_pages=max_pages, block_size=BLOCK, page_size=PAGE,
                budget_pages=args.budget // PAGE, sink_pages=1, recent_pages=2,
                gqa_reduce="max", append_newest=True, physical=True, counters=None)
        finally:
            tqs._select_kernel = real_select
        if where == "attention":
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                job()
        kv.sum(dtype=torch.float32)
        if job is not None:
            torch.cuda.current_stream().wait_stream(side)
        y = F.linear(x, w_o)
        F.linear(y[:, :HIDDEN], w_gu)

    def graph_us(step) -> float:
        """Median microseconds a layer of `step` (one pass over every copy), from a graph."""
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        times = sorted(ms * 1e3 / len(layers) for ms in cuda_times_ms(graph.replay, args.reps))
        return round(times[len(times) // 2], 2)

    def time_variant(where: str, how: str = "plain", programs: int = 120) -> float:
        return graph_us(lambda: [layer(*copy, where, how, programs) for copy in layers])

    pieces_of_a_layer = {
        "o_proj_cold": lambda d, w, k: (k.sum(dtype=torch.float32), F.linear(x, w)),
        "o_proj_after_prefetch": lambda d, w, k: (prefetch(w, sink, "evict_last", 120),
                                                  F.linear(x, w)),
        "prefetch_alone": lambda d, w, k: prefetch(w, sink, "evict_last", 120),
        "bulk_prefetch_alone": lambda d, w, k: prefetch(w, sink, "bulk", 120),
        "kv_read_alone": lambda d, w, k: k.sum(dtype=torch.float32),
    }

    rows = []
    for rnd in range(3):
        row = {"round": rnd, "none_us": time_variant("none")}
        for how in ("plain", "evict_last", "bulk"):
            for where in ("select", "attention"):
                row[f"{where}_{how}_us"] = time_variant(where, how)
        for programs in (32, 64):
            row[f"select_evict_last_p{programs}_us"] = time_variant("select", "evict_last", programs)
        print(row, flush=True)
        rows.append(row)
    pieces = {name + "_us": graph_us(lambda fn=fn: [fn(*copy) for copy in layers])
              for name, fn in pieces_of_a_layer.items()}
    print(pieces, flush=True)
    save("l2_prefetch", {"rows": rows, "pieces": pieces, "context": args.context,
                         "budget": args.budget, "copies": args.copies})


if __name__ == "__main__":
    main()
