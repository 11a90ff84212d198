"""Host time of one launch: F.linear at batch 1, a torch add, two fused Triton kernels.

Each call is issued 2,000 times back to back without waiting for the GPU; the figure is the
host's microseconds per call, which is what an eager decode step pays per op.

    python benchmarks/launch_cost.py        # GPU
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from common import save  # noqa: I001
from astream.ops.triton_layer import add_rms_norm_triton, silu_mul_triton


def host_us(fn, n: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    per_call = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    return round(per_call, 1)


def main() -> None:
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x, norm = torch.randn(1, 2560, **bf16), torch.ones(2560, **bf16)
    w, w_up = torch.randn(2560, 2560, **bf16), torch.randn(19456, 2560, **bf16)
    gate_up = torch.randn(1, 19456, **bf16)
    results = {"F.linear 2560x2560 M=1": host_us(lambda: F.linear(x, w)),
               "F.linear 19456x2560 M=1": host_us(lambda: F.linear(x, w_up)),
               "torch add": host_us(lambda: x + x),
               "add_rms_norm_triton": host_us(lambda: add_rms_norm_triton(x, x, norm, 1e-6)),
               "silu_mul_triton": host_us(lambda: silu_mul_triton(gate_up))}
    for name, us in results.items():
        print(f"{name:<26}{us:>8} us")
    save("launch_cost", results)


if __name__ == "__main__":
    main()
