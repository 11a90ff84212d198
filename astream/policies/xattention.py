"""XAttention (Xu et al., ICML 2025): block-sparse prefill chosen by antidiagonal scoring.

Each prefill chunk's attention (over its prefix and itself) is estimated per block x
block tile from strided antidiagonals, and each query block reads only the key blocks
whose estimated attention reaches `threshold` of its total, plus its first and diagonal
blocks (astream.ops.xattention). Decode stays Full. `threshold=1.0` is exact full attention.
With offload, each chunk's prefix comes to the device whole for this (see
executor/offload_attention.py), so both paths select the same blocks. The scores are the
reference code's; its selection keeps one block past the threshold on a prompt without a
prefix, a bookkeeping artifact this rule does not copy (docs/BENCHMARKS.md, "Agreement with
the authors' code").
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from astream.ops import xattention as ops
from astream.policies.base import KVLayout, SparsePolicy, check_int
from astream.policies.sparse_prefill import (
    SequencePrefillRuntime, prefill_counters, prefill_traits,
)


@dataclass(slots=True, frozen=True)
class XAttentionPolicy(SparsePolicy):
    threshold: float = 0.95
    block_size: int = 128
    stride: int = 8
    dense_tail: int = 128
    name = "xattention"
    phase = "prefill"

    def __post_init__(self) -> None:
        check_int("XAttentionPolicy", "dense_tail", self.dense_tail, 0)
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                or not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"XAttentionPolicy threshold must be in (0, 1], got {self.threshold!r}")
        for key in ("block_size", "stride"):
            check_int("XAttentionPolicy", key, getattr(self, key), 1)
        if self.block_size & (self.block_size - 1) or self.block_size < 16:
            raise ValueError(f"XAttentionPolicy block_size must be a power of two >= 16, "
                             f"got {self.block_size}")
        try:
            ops.check_shape(self.block_size, self.stride)
        except ValueError as exc:
            raise ValueError(f"XAttentionPolicy: {exc}") from None

    def bind(self, layout: KVLayout) -> "XAttentionRuntime":
        return XAttentionRuntime(counters=prefill_counters(layout), traits=prefill_traits(layout),
                                 policy=self)


@dataclass(slots=True)
class XAttentionRuntime(SequencePrefillRuntime):
    policy: XAttentionPolicy          # counters: blocks kept, blocks causally visible

    def attend_sequence(self, layer: int, q: Tensor, k: Tensor, v: Tensor,
                        scale: float) -> tuple[Tensor, Tensor, Tensor, int]:
        block = self.policy.block_size
        mask = self._mask(q, k, scale)
        out, lse = ops.block_sparse_attention(q, k, v, mask, block=block, scale=scale)
        return out, lse, mask.sum(), ops.visible_block_count(q.shape[0], k.shape[0], block) * q.shape[1]

    def _mask(self, q: Tensor, k: Tensor, scale: float) -> Tensor:
        policy = self.policy
        n_q, n_k = q.shape[0], k.shape[0]
        if policy.threshold >= 1.0:        # exact: every visible block, nothing to estimate
            return ops.visible_mask(q.shape[1], n_q, n_k, policy.block_size, q.device)
        scores = ops.antidiagonal_scores(q, k, block=policy.block_size, stride=policy.stride,
                                         scale=scale)
        return ops.select_blocks_ref(scores, threshold=policy.threshold, n_q=n_q, n_k=n_k,
                                     block=policy.block_size)

    def stats(self) -> dict:
        """Share of the causally visible key blocks prefill read, by layer, and the totals
        (blocks read, blocks visible) over every layer."""
        return self.density_stats("xattention_density", "xattention_blocks")
