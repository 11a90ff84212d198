"""The decoder's linear layers at decode batch sizes: cuBLAS (F.linear) against the skinny
Triton kernel (ops/triton_skinny.py) at several tile shapes.

Qwen3-4B's shapes (bf16). Each call reads a different copy of the weight, as a decode step's
layers do, so the weight comes from HBM and not from L2; calls are replayed from a CUDA
graph, so the figure is GPU time. Every variant is checked against F.linear. Medians of
--reps replays, us per call and the weight's bytes per second.

    python benchmarks/skinny_linear.py [--rows 1,4]
"""

from __future__ import annotations

import argparse

import torch
import triton

from common import cuda_times_ms, save  # noqa: I001
from astream.ops.triton_skinny import skinny_linear_triton

SHAPES = {"qkv": (6144, 2560), "o_proj": (2560, 4096), "gate_up": (19456, 2560),
          "down": (2560, 9728)}
COPIES = 8
CONFIGS = [(bn, bk, w, s) for bn in (16, 32, 64) for bk in (128, 256, 512) for w in (4, 8)
           for s in (3, 4)]


def time_us(fn, reps: int) -> float:
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(COPIES * 2):
            fn(i % COPIES)
    times = sorted(ms * 1e3 / (COPIES * 2) for ms in cuda_times_ms(graph.replay, reps))
    return round(times[len(times) // 2], 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    results = []
    for name, (n_out, n_in) in SHAPES.items():
        weights = [torch.randn(n_out, n_in, device="cuda").bfloat16() * 0.02 for _ in range(COPIES)]
        gbytes = n_out * n_in * 2 / 1e9
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, n_in, device="cuda").bfloat16()
            want = torch.nn.functional.linear(x, weights[0]).float()
            row = {"shape": name, "rows": rows,
                   "cublas_us": time_us(lambda i: torch.nn.functional.linear(x, weights[i]),
                                        args.reps)}
            row["cublas_tb_s"] = round(gbytes / row["cublas_us"] * 1e3, 2)
            best = None
            for bn, bk, warps, stages in CONFIGS:
                def call(i, bn=bn, bk=bk, warps=warps, stages=stages):
                    return skinny_linear_triton(x, weights[i], block_n=bn, block_k=bk,
                                                num_warps=warps, num_stages=stages)
                try:
                    got = call(0).float()
                except triton.runtime.errors.OutOfResources:
                    continue
                err = ((got - want).abs().max() / want.abs().max()).item()
                if err > 1e-2:
                    row[f"bad_{bn}_{bk}_{warps}_{stages}"] = err
                    continue
                us = time_us(call, args.reps)
                if best is None or us < best[0]:
                    best = (us, bn, bk, warps, stages)
            row["triton_best_us"], *cfg = best
            row["triton_best_config"] = "bn%d bk%d w%d s%d" % tuple(cfg)
            row["triton_tb_s"] = round(gbytes / best[0] * 1e3, 2)
            print(row, flush=True)
            results.append(row)
    save("skinny_linear", {"rows": results})


if __name__ == "__main__":
    main()
