"""Fast varlen attention on CUDA through FlashAttention-2.

Two sources, both optional: the `flash_attn` package, else the FA2 kernels that
ship inside PyTorch (`aten._flash_attention_forward`, a private op). Importing
this module never needs CUDA or flash-attn. Both kernels write lse = +inf for a
row that sees no key; we rewrite that to -inf so it merges as an empty set.
"""

from __future__ import annotations

import functools
from types import ModuleType
import torch
from torch import Tensor

from astream.ops.varlen import VarlenMeta

# FlashAttention-2 runs on Ampere (sm80) and newer, fp16/bf16, head_dim % 8 == 0, <= 256.
MIN_CAPABILITY = (8, 0)
MAX_HEAD_DIM = 256


@functools.cache
def _flash_attn_module() -> ModuleType | None:
    try:
        import flash_attn
    except Exception:  # ImportError, or a broken build failing to load its .so
        return None
    return flash_attn


def _cuda_capable(device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def head_dim_supported(head_dim: int) -> bool:
    return head_dim % 8 == 0 and 0 < head_dim <= MAX_HEAD_DIM


def flash_attn_available(device: torch.device) -> bool:
    """True if the flash_attn package imports and `device` is an sm80+ GPU."""
    return _cuda_capable(device) and _flash_attn_module() is not None


def torch_flash_available(device: torch.device) -> bool:
    """True if this torch build ships its FA2 kernels and `device` is an sm80+ GPU."""
    if not _cuda_capable(device):
        return False
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return False
    probe = getattr(torch.backends.cuda, "is_flash_attention_available", None)
    return bool(probe()) if probe is not None else True


def _empty_rows_to_neginf(lse_ht: Tensor) -> Tensor:
    """lse [H, T] from FA2 -> [T, H] view with +inf (no keys) turned into -inf."""
    lse_ht.masked_fill_(torch.isposinf(lse_ht), float("-inf"))
    return lse_ht.t()


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def flash_attn_varlen(
    q: Tensor, k: Tensor, v: Tensor, meta: VarlenMeta, *, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """Varlen attention via `flash_attn.flash_attn_varlen_func` (fp16/bf16, CUDA)."""
    module = _flash_attn_module()
    if module is None:
        raise RuntimeError("flash_attn is not importable")
    # return_attn_probs=True only adds the lse; the probability matrix is not built without dropout.
    out, lse, _ = module.flash_attn_varlen_func(
        _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v),
        meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
        dropout_p=0.0, softmax_scale=scale, causal=causal, return_attn_probs=True,
    )
    return out, _empty_rows_to_neginf(lse)


def torch_flash_varlen(
    q: Tensor, k: Tensor, v: Tensor, meta: VarlenMeta, *, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """Varlen attention via torch's bundled FA2 (handles GQA: k/v may have fewer heads).

    The op returns (out, logsumexp [H, T], philox_seed, philox_offset, debug_mask).
    """
    result = torch.ops.aten._flash_attention_forward(
        _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v),
        meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
        0.0, causal, False, scale=scale,
    )
    out, lse = result[0], result[1]
    return out, _empty_rows_to_neginf(lse)
