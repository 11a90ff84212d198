"""A linear layer for the few rows of a small decode batch (CUDA; also runs under
TRITON_INTERPRET=1). Reference: torch.nn.functional.linear.

With one to a few rows, y = x @ W^T is a pass over the weight at HBM speed and nothing
else. cuBLAS picks tiles for it by heuristics; for some of a decoder's shapes they leave
SMs idle (on the H100, Qwen3-4B's o_proj, 4096 -> 2560, moved its weight at 1.5 TB/s). This
kernel gives each program a stripe of output columns, streams that stripe of W through
the tensor cores against the rows (padded to the 16 a dot needs) and accumulates in
float32, as cuBLAS does, rounding once to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

MAX_ROWS = 16          # rows one program holds; more go to cuBLAS


@triton.jit
def _skinny_linear_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, rows, n_out, n_in,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, ROWS_PAD)
    col_ok = cols < n_out
    acc = tl.zeros([ROWS_PAD, BLOCK_N], tl.float32)
    for start in range(0, n_in, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        k_ok = k < n_in
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :],
                    mask=(m[:, None] < rows) & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + k[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(m[:, None] < rows) & col_ok[None, :])


def skinny_linear_triton(x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                         block_n: int = 32, block_k: int = 256, num_warps: int = 4,
                         num_stages: int = 4) -> Tensor:
    """F.linear(x, weight, bias) for x [rows <= MAX_ROWS, in] (unit column strides)."""
    rows, n_in = x.shape
    n_out = weight.shape[0]
    if rows > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got {rows}")
    y = torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    _skinny_linear_kernel[(triton.cdiv(n_out, block_n),)](
        x, weight, bias if bias is not None else weight, y, rows, n_out, n_in,
        x.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
        ROWS_PAD=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        num_stages=num_stages,
    )
    return y
