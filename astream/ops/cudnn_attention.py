"""Long prefill attention through cuDNN's fused attention (torch's private SDPA op).

On Hopper, cuDNN's attention runs prefill-sized problems well above the FlashAttention-2
kernels torch bundles (measured in docs/BENCHMARKS.md), and returns the lse the engine
merges by. It serves one sequence at a time in dense [1, H, T, D] form, which is a strided
view of the packed [T, H, D] rows, so nothing is copied. K/V may have fewer heads (GQA).

cuDNN's causal mask is top-left aligned, the engine's bottom-right (a chunk sees its whole
prefix), so a chunk after a prefix is two problems merged by lse: the chunk over the
prefix without a mask, and the causal square of the chunk over itself.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import Tensor

from astream.ops.varlen import VarlenMeta

# cuDNN's fused attention is fastest on Hopper; on Ampere and Blackwell the FlashAttention
# kernels match or beat it, so only sm90 takes this path.
CUDNN_CAPABILITY_MAJOR = 9
CUDNN_MAX_HEAD_DIM = 128

DenseFn = Callable[..., tuple[Tensor, Tensor]]
MergeFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
PartFn = Callable[[Tensor, Tensor, Tensor, VarlenMeta], tuple[Tensor, Tensor]]


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cudnn_attention_available(device: torch.device, head_dim: int) -> bool:
    """True on a Hopper GPU whose torch build carries cuDNN attention and has it enabled."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        return False
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return (_capability(index)[0] == CUDNN_CAPABILITY_MAJOR and head_dim % 8 == 0
            and head_dim <= CUDNN_MAX_HEAD_DIM)


def cudnn_dense(q: Tensor, k: Tensor, v: Tensor, *, causal: bool,
                scale: float) -> tuple[Tensor, Tensor]:
    """One sequence: q [Tq, H, D], k/v [Tk, KVH, D] -> out [Tq, H, D], lse [Tq, H] float32.

    causal is top-left aligned (query i sees keys j <= i); the callers pass Tq == Tk.
    """
    heads_first = [x.unsqueeze(0).transpose(1, 2) for x in (q, k, v)]
    result = torch.ops.aten._scaled_dot_product_cudnn_attention(
        *heads_first, None, True, 0.0, causal, False, scale=scale)
    out = result[0].transpose(1, 2).squeeze(0)
    lse = result[1].reshape(q.shape[1], q.shape[0]).t()
    return out, lse


def one_sequence(dense: DenseFn, merge: MergeFn, q: Tensor, k: Tensor, v: Tensor, *,
                 causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Varlen semantics for one sequence (causal bottom-right aligned) from a dense kernel
    whose causal mask is top-left aligned: prefix part and causal square, merged by lse."""
    n_q, n_k = q.shape[0], k.shape[0]
    if not causal or n_k == n_q:
        return dense(q, k, v, causal=causal, scale=scale)
    if n_k < n_q:
        raise ValueError(f"causal attention of {n_q} queries over {n_k} keys: "
                         "the first queries would see no key")
    prefix = n_k - n_q
    out, lse = dense(q, k[:prefix], v[:prefix], causal=False, scale=scale)
    square_out, square_lse = dense(q, k[prefix:], v[prefix:], causal=True, scale=scale)
    rows = torch.arange(n_q, device=q.device)
    return merge(out, lse.contiguous(), rows, square_out, square_lse)


def by_sequence(long_part: PartFn, short_part: PartFn, q: Tensor, k: Tensor, v: Tensor,
                meta: VarlenMeta, *, takes_long: Callable[[int, int], bool]) -> tuple[Tensor, Tensor]:
    """A packed batch one sequence at a time: sequences whose (queries, keys) `takes_long`
    accepts through long_part, the others through short_part, each given its rows and a
    one-sequence meta (device offsets sliced from the batch's, so nothing waits on a copy)."""
    cu_q, cu_k = meta.host_cu_seqlens_q, meta.host_cu_seqlens_k
    if len(cu_q) == 2:
        part = long_part if takes_long(cu_q[1], cu_k[1]) else short_part
        return part(q, k[:cu_k[1]], v[:cu_k[1]], meta)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        one = VarlenMeta(meta.cu_seqlens_q[s:s + 2] - meta.cu_seqlens_q[s],
                         meta.cu_seqlens_k[s:s + 2] - meta.cu_seqlens_k[s],
                         q1 - q0, k1 - k0, [0, q1 - q0], [0, k1 - k0])
        part = long_part if takes_long(q1 - q0, k1 - k0) else short_part
        out[q0:q1], lse[q0:q1] = part(q[q0:q1], k[k0:k1], v[k0:k1], one)
    return out, lse
