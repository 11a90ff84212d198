"""MInference, vertical-slash (Jiang et al., NeurIPS 2024): sparse prefill over the key
columns and diagonals the chunk's last queries attend to most.

Each prefill chunk's attention (over its prefix and itself) is replaced, head by head, by
attention over the pattern of astream.ops.minference: the top `vertical_size` key columns
(always the first `sink`) and the top `slash_size` diagonals (always the nearest `local`),
estimated from the chunk's last `last_q` queries. The sizes are the paper's, kept at
every length as its code does (a shorter prompt then keeps a larger share: that is what
keeps its accuracy on the multi-item tasks at 16-32K, docs/BENCHMARKS.md); with
`scale_with_length` they shrink in proportion to the keys a chunk sees instead, never
below `sink` columns and `local` diagonals. Sizes that cover every key (e.g. `scale_with_length=False` and
sizes of the longest prompt) are exactly full attention. Decode stays Full (or Quest, combined).
With offload, each chunk's prefix comes to the device whole for this (see
executor/offload_attention.py), so both paths select the same keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from astream.ops import minference as ops
from astream.policies.base import KVLayout, SparsePolicy, check_int
from astream.policies.sparse_prefill import (
    SequencePrefillRuntime, prefill_counters, prefill_traits,
)

REFERENCE_CONTEXT = 131072       # the context the default sizes are set for


@dataclass(slots=True, frozen=True)
class MInferencePolicy(SparsePolicy):
    vertical_size: int = 1000
    slash_size: int = 6096
    last_q: int = 64
    sink: int = 30
    local: int = 100
    block_size: int = 64
    scale_with_length: bool = False
    dense_tail: int = 128
    name = "minference"
    phase = "prefill"

    def __post_init__(self) -> None:
        check_int("MInferencePolicy", "dense_tail", self.dense_tail, 0)
        for key in ("vertical_size", "slash_size", "last_q", "block_size"):
            check_int("MInferencePolicy", key, getattr(self, key), 1)
        for key in ("sink", "local"):
            check_int("MInferencePolicy", key, getattr(self, key), 0)
        if self.block_size & (self.block_size - 1) or self.block_size < 16:
            raise ValueError(f"MInferencePolicy block_size must be a power of two >= 16, "
                             f"got {self.block_size}")
        if not isinstance(self.scale_with_length, bool):
            raise ValueError(f"MInferencePolicy scale_with_length must be a bool, "
                             f"got {self.scale_with_length!r}")

    def sizes(self, n_k: int) -> tuple[int, int]:
        """(columns, diagonals) kept for a chunk that sees `n_k` keys."""
        vertical, slash = self.vertical_size, self.slash_size
        if self.scale_with_length:
            share = min(1.0, n_k / REFERENCE_CONTEXT)
            vertical, slash = round(vertical * share), round(slash * share)
        # Never fewer than the columns and diagonals that are always kept.
        return min(max(vertical, self.sink, 1), n_k), min(max(slash, self.local, 1), n_k)

    def bind(self, layout: KVLayout) -> "MInferenceRuntime":
        return MInferenceRuntime(counters=prefill_counters(layout), traits=prefill_traits(layout),
                                 policy=self)


@dataclass(slots=True)
class MInferenceRuntime(SequencePrefillRuntime):
    policy: MInferencePolicy          # counters: keys read, keys its query blocks could see

    def attend_sequence(self, layer: int, q: Tensor, k: Tensor, v: Tensor,
                        scale: float) -> tuple[Tensor, Tensor, Tensor, int]:
        policy, block = self.policy, self.policy.block_size
        vertical, slash = policy.sizes(k.shape[0])
        index = ops.vertical_slash_index(q, k, last_q=policy.last_q, vertical_size=vertical,
                                         slash_size=slash, sink=policy.sink, local=policy.local,
                                         scale=scale)
        layout = ops.vertical_slash_layout(index, q.shape[0], k.shape[0], block)
        out, lse = ops.vertical_slash_attention(q, k, v, index, block=block, scale=scale,
                                                layout=layout)
        return (out, lse, *ops.layout_density(layout, q.shape[0], k.shape[0], block))

    def stats(self) -> dict:
        """Share of the keys its query blocks could see that prefill read, by layer, and the
        totals (keys read, keys visible) over every layer."""
        return self.density_stats("minference_density", "minference_keys")

