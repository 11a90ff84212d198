"""XAttention (Xu et al., ICML 2025): block-sparse prefill chosen by antidiagonal scoring.

Each prefill chunk's attention (over its prefix and itself) is estimated per block x
block tile from strided antidiagonals, and each query block reads only the key blocks
whose estimated attention reaches `threshold` of its total, plus its first and diagonal
blocks (astream.ops.xattention). Decode stays Full. `threshold=1.0` is exact full attention.
Not yet with offload: there the prefix reaches attention slot by slot through the ring,
and the estimate would need the whole prefix's keys first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from astream.ops import xattention as ops
from astream.ops.varlen import VarlenMeta
from astream.policies.base import KVLayout, PolicyRuntime, SparsePolicy


@dataclass(slots=True, frozen=True)
class XAttentionPolicy(SparsePolicy):
    threshold: float = 0.9
    block_size: int = 128
    stride: int = 8
    name = "xattention"
    supports_offload = False

    def __post_init__(self) -> None:
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                or not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"XAttentionPolicy threshold must be in (0, 1], got {self.threshold!r}")
        for key in ("block_size", "stride"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"XAttentionPolicy {key} must be a positive integer, got {value!r}")
        if self.block_size & (self.block_size - 1) or self.block_size < 16:
            raise ValueError(f"XAttentionPolicy block_size must be a power of two >= 16, "
                             f"got {self.block_size}")
        try:
            ops.check_shape(self.block_size, self.stride)
        except ValueError as exc:
            raise ValueError(f"XAttentionPolicy: {exc}") from None

    def bind(self, layout: KVLayout) -> "XAttentionRuntime":
        if layout.offload:
            raise ValueError("sparse_policy 'xattention' does not work with offload yet")
        counters = torch.zeros(layout.num_layers, 2, dtype=torch.int64, device=layout.device)
        return XAttentionRuntime(self, counters)


@dataclass(slots=True)
class XAttentionRuntime(PolicyRuntime):
    policy: XAttentionPolicy
    counters: Tensor                  # [layers, 2]: blocks kept, blocks causally visible

    def prefill_attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta: VarlenMeta,
                          causal: bool, scale: float) -> tuple[Tensor, Tensor] | None:
        if not causal:
            return None
        policy = self.policy
        out = torch.empty_like(q)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        cq, ck = meta.host_cu_seqlens_q, meta.host_cu_seqlens_k
        for seq in range(len(cq) - 1):
            q0, q1, k0, k1 = cq[seq], cq[seq + 1], ck[seq], ck[seq + 1]
            if q1 == q0:
                continue
            mask = self._mask(q[q0:q1], k[k0:k1], scale)
            out[q0:q1], lse[q0:q1] = ops.block_sparse_attention(
                q[q0:q1], k[k0:k1], v[k0:k1], mask, block=policy.block_size, scale=scale)
            self.counters[layer, 0] += mask.sum()
            self.counters[layer, 1] += ops.visible_block_count(q1 - q0, k1 - k0,
                                                               policy.block_size) * q.shape[1]
        return out, lse

    def _mask(self, q: Tensor, k: Tensor, scale: float) -> Tensor:
        policy = self.policy
        n_q, n_k = q.shape[0], k.shape[0]
        if policy.threshold >= 1.0:        # exact: every visible block, nothing to estimate
            return ops.visible_mask(q.shape[1], n_q, n_k, policy.block_size, q.device)
        scores = ops.antidiagonal_scores_ref(q, k, block=policy.block_size, stride=policy.stride,
                                             scale=scale)
        return ops.select_blocks_ref(scores, threshold=policy.threshold, n_q=n_q, n_k=n_k,
                                     block=policy.block_size)

    def stats(self) -> dict:
        """Share of the causally visible key blocks prefill read, by layer."""
        kept, visible = self.counters.cpu().unbind(1)
        return {"xattention_density": [round(k / v, 4) if v else None
                                       for k, v in zip(kept.tolist(), visible.tolist())]}
