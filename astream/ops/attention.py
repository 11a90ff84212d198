"""Public attention entry points; each picks the best backend for the tensors' device.

Every call returns (out, lse): lse is the natural-log log-sum-exp of the scaled
scores per (token, head) in float32, so results over disjoint key sets can be
combined exactly with `merge_attention`. Rows that see no key return out = 0 and
lse = -inf on every backend.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from astream.ops import attention_ref, flash
from astream.ops.varlen import VarlenMeta

__all__ = ["VarlenMeta", "merge_attention", "select_backend", "select_decode_backend",
           "varlen_attention", "varlen_backend_for"]

HALF_DTYPES = (torch.float16, torch.bfloat16)


def select_backend(device: torch.device | str) -> str:
    """Varlen backend for fp16/bf16 on `device`: "flash_attn" | "torch_flash" | "reference".

    Float32 inputs and unsupported head dims always use "reference"
    (see `varlen_backend_for`).
    """
    device = torch.device(device)
    if flash.flash_attn_available(device):
        return "flash_attn"
    if flash.torch_flash_available(device):
        return "torch_flash"
    return "reference"


def varlen_backend_for(q: Tensor) -> str:
    """The backend `varlen_attention` will actually use for this query tensor."""
    if q.dtype not in HALF_DTYPES or not flash.head_dim_supported(q.shape[-1]):
        return "reference"
    return select_backend(q.device)


def varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, meta: VarlenMeta, *, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """q [Tq, H, D], k/v [Tk, KVH, D] -> out [Tq, H, D] (q.dtype), lse [Tq, H] float32.

    On the flash backends lse may be a transposed (non-contiguous) view.
    """
    backend = varlen_backend_for(q)
    if backend == "flash_attn":
        return flash.flash_attn_varlen(q, k, v, meta, causal=causal, scale=scale)
    if backend == "torch_flash":
        return flash.torch_flash_varlen(q, k, v, meta, causal=causal, scale=scale)
    return attention_ref.varlen_attention_ref(q, k, v, meta, causal=causal, scale=scale)


@functools.cache
def _triton_decode_importable() -> bool:
    try:
        import astream.ops.triton_decode  # noqa: F401
    except ImportError:
        return False
    return True


def select_decode_backend(device: torch.device | str) -> str:
    """Paged-decode backend for `device`: "triton" | "reference"."""
    device = torch.device(device)
    if device.type == "cuda" and _triton_decode_importable():
        return "triton"
    return "reference"


def merge_attention(
    out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor
) -> tuple[Tensor, Tensor]:
    """Exact merge of two partial results over disjoint key sets.

    out [..., H, D], lse [..., H]; lse = -inf marks an empty side. Returns out in
    out_a.dtype and lse in float32.
    """
    lse_a, lse_b = lse_a.float(), lse_b.float()
    peak = torch.maximum(lse_a, lse_b)
    # Both sides empty -> peak is -inf; shifting by 0 keeps the weights at exp(-inf) = 0.
    peak = torch.where(torch.isneginf(peak), torch.zeros_like(peak), peak)
    w_a = torch.exp(lse_a - peak)
    w_b = torch.exp(lse_b - peak)
    total = w_a + w_b
    denom = torch.where(total > 0, total, torch.ones_like(total))
    out = (out_a.float() * (w_a / denom).unsqueeze(-1)
           + out_b.float() * (w_b / denom).unsqueeze(-1))
    return out.to(out_a.dtype), peak + torch.log(total)


def merge_into_rows_ref(out: Tensor, lse: Tensor, rows: Tensor, part_out: Tensor,
                        part_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Merge a partial result (part_out [R, H, D], part_lse [R, H]) over other keys into
    rows [R] (distinct) of out [T, H, D] / lse [T, H] float32. Returns the merged (out,
    lse); kernels may update the given tensors in place, so use only the returned ones."""
    merged_out, merged_lse = merge_attention(out.index_select(0, rows), lse.index_select(0, rows),
                                             part_out, part_lse)
    return out.index_copy(0, rows, merged_out), lse.index_copy(0, rows, merged_lse)

