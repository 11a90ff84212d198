"""The attention kernels one engine uses, chosen once when it is built.

`AttentionBackends.select(device, dtype, head_dim)` picks the varlen kernel (flash-attn,
torch's bundled FlashAttention-2, or the torch reference), whether long single-sequence
prefill parts go to cuDNN's attention instead (Hopper), and the paged-decode kernel
(Triton or the reference) for the model's dtype and head size; the attention adapters
call through it, so no layer or ring slot decides again.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from astream.ops import attention_ref, cudnn_attention, flash, pages
from astream.ops.attention import (
    HALF_DTYPES, merge_into_rows_ref, select_backend, select_decode_backend,
)
from astream.ops.varlen import VarlenMeta

VarlenFn = Callable[..., tuple[Tensor, Tensor]]
# A sequence with fewer queries in a part keeps FlashAttention-2: too small for cuDNN's lead
# to pay for its extra launches (see docs/BENCHMARKS.md, prefill kernels).
CUDNN_MIN_QUERIES = 2048
# cuDNN builds an execution plan for every new problem shape, so only parts whose lengths
# are multiples of the ladder's step go to it (cut there into the ladder's few shapes, whose
# plans the engine builds at startup): the full chunks of a chunked prefill and their
# chunk-aligned prefixes. A prompt's ragged last chunk keeps FlashAttention-2.
CUDNN_SHAPE_STEP = cudnn_attention.LADDER.step
KVScalesArg = tuple[Tensor, Tensor] | None      # (k, v) [KVH] float32 of a scaled (fp8) cache

_VARLEN: dict[str, VarlenFn] = {
    "flash_attn": flash.flash_attn_varlen,
    "torch_flash": flash.torch_flash_varlen,
    "reference": attention_ref.varlen_attention_ref,
}


def takes_cudnn(num_queries: int, num_keys: int) -> bool:
    """Whether a one-sequence part of this shape goes to cuDNN (long, and of a repeating shape)."""
    return (num_queries >= CUDNN_MIN_QUERIES and num_queries % CUDNN_SHAPE_STEP == 0
            and num_keys % CUDNN_SHAPE_STEP == 0)


@dataclass(slots=True, frozen=True)
class AttentionBackends:
    varlen_name: str                  # "flash_attn" | "torch_flash" | "reference"
    decode_name: str                  # "triton" | "reference"
    cudnn_prefill: bool = False       # parts `takes_cudnn` accepts go through cuDNN attention

    @classmethod
    def select(cls, device: torch.device, dtype: torch.dtype, head_dim: int) -> "AttentionBackends":
        varlen = select_backend(device)
        if dtype not in HALF_DTYPES or not flash.head_dim_supported(head_dim):
            varlen = "reference"
        cudnn = varlen != "reference" and cudnn_attention.cudnn_attention_available(device, head_dim)
        return cls(varlen, select_decode_backend(device), cudnn)

    def varlen(self, q: Tensor, k: Tensor, v: Tensor, meta: VarlenMeta, *, causal: bool,
               scale: float) -> tuple[Tensor, Tensor]:
        """q [Tq, H, D], k/v [Tk, KVH, D] -> out [Tq, H, D], lse [Tq, H] (maybe a transposed view)."""
        kernel = _VARLEN[self.varlen_name]
        if not self.cudnn_prefill or meta.max_seqlen_q < CUDNN_MIN_QUERIES:
            return kernel(q, k, v, meta, causal=causal, scale=scale)

        def short_part(q, k, v, one: VarlenMeta) -> tuple[Tensor, Tensor]:
            return kernel(q, k, v, one, causal=causal, scale=scale)

        def long_part(q, k, v, one: VarlenMeta) -> tuple[Tensor, Tensor]:
            try:
                return cudnn_attention.one_sequence(cudnn_attention.cudnn_dense,
                                                    self.merge_into_rows, q, k, v,
                                                    causal=causal, scale=scale)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as exc:   # no plan for this shape, a cuDNN/driver mismatch
                # The other kernel computes the same attention: the request goes on.
                warnings.warn(f"cuDNN attention failed ({str(exc)[:200]}); this part uses "
                              f"the {self.varlen_name} kernel", RuntimeWarning, stacklevel=2)
                return short_part(q, k, v, one)

        return cudnn_attention.by_sequence(long_part, short_part, q, k, v, meta,
                                           takes_long=takes_cudnn)

    def paged_decode(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                     context_lens: Tensor, *, scale: float, max_context_len: int,
                     kv_scales: KVScalesArg = None) -> tuple[Tensor, Tensor]:
        """One query token per sequence over a paged cache -> out [B, H, D], lse [B, H].

        q [B, H, D]; caches [num_blocks, block_size, KVH, D]; block_tables [B, max_blocks]
        int32; context_lens [B] int32 (0 = no keys). On CUDA, max_context_len only sizes
        the split count (keep it fixed per captured graph); the reference path needs
        it >= every context length. kv_scales (k, v: [KVH] float32): the caches hold
        stored values (fp8) of key / k[head] and value / v[head].
        """
        args = (q, k_cache, v_cache, block_tables, context_lens)
        kwargs = dict(scale=scale, max_context_len=max_context_len, kv_scales=kv_scales)
        if self.decode_name == "triton":
            from astream.ops import triton_decode

            return triton_decode.paged_decode_triton(*args, **kwargs)
        return attention_ref.paged_decode_attention_ref(*args, **kwargs)

    def paged_decode_selected(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                              page_indices: Tensor, page_counts: Tensor, context_lens: Tensor, *,
                              page_size: int, scale: float,
                              kv_scales: KVScalesArg = None) -> tuple[Tensor, Tensor]:
        """Decode over selected pages per KV head (see ops.pages.paged_decode_selected_ref)."""
        args = (q, k_cache, v_cache, block_tables, page_indices, page_counts, context_lens)
        kwargs = dict(page_size=page_size, scale=scale, kv_scales=kv_scales)
        if self.decode_name == "triton":
            from astream.ops import triton_pages

            return triton_pages.paged_decode_selected_triton(*args, **kwargs)
        return pages.paged_decode_selected_ref(*args, **kwargs)

    def merge_into_rows(self, out: Tensor, lse: Tensor, rows: Tensor, part_out: Tensor,
                        part_lse: Tensor) -> tuple[Tensor, Tensor]:
        """A partial result merged into some rows (see ops.attention.merge_into_rows_ref)."""
        if self.decode_name == "triton" and out.stride(-1) == 1 and part_out.stride(-1) == 1:
            from astream.ops import triton_merge

            return triton_merge.merge_into_rows_triton(out, lse, rows, part_out, part_lse)
        return merge_into_rows_ref(out, lse, rows, part_out, part_lse)

