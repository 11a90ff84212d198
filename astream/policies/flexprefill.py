"""FlexPrefill (Lai et al., ICLR 2025): block-sparse prefill whose pattern and budget adapt
per head and per input.

Each prefill chunk's attention (over its prefix and itself) is estimated from the chunk's
last query block. A prompt prefilled in one chunk is estimated as the authors' code does,
from its end (the question); smaller chunks lose accuracy (docs/ENGINE.md), so where
max_num_batched_tokens is unset the engine prefills in chunks of `chunk_tokens` on CUDA. Per head, a query-aware pattern (block-mean queries against block-mean
keys) is used where that cheap estimate agrees with the head's true last-block attention
(square-root Jensen-Shannon divergence below `tau`), else a vertical-slash pattern; either
way the head keeps the fewest blocks whose estimated attention reaches `gamma`, with at
least `min_budget` keys of columns and of diagonals (vertical-slash heads at most
`max_budget`, if set), plus the first key block and the causal diagonal
(astream.ops.flexprefill). The attention over the kept blocks is XAttention's block-sparse
kernel. `gamma=1.0`, or a `min_budget` that covers every key, is exactly full attention.
Decode stays Full (or Quest, combined). With offload, each chunk's prefix comes to the
device whole for this (see executor/offload_attention.py), so both paths select the same
blocks.

Defaults: gamma 0.99, tau 0.1, min_budget 1024 tokens, no max_budget, block 128, the
last 128 queries of each chunk read densely (`dense_tail`, policies/sparse_prefill.py),
and chunks of 32768 tokens (`chunk_tokens`; 0 leaves the engine's default).
The paper and its code use tau 0.1 and block 128 everywhere, gamma 0.9 or 0.95 by model
and a minimum budget of 1024 in their RULER and InfiniteBench runs (512 in the README's
example). The higher gamma is taken because on Qwen2.5-Coder-0.5B at 16-32K gamma 0.95
lost 15 points of Full's RULER-style accuracy (8 with the dense tail) and gamma 0.99 with
the tail 2 (docs/BENCHMARKS.md): a lost fact costs more than the extra blocks.

Where this differs from the authors' code, on purpose: a budget is counted in blocks from
the blocks' own estimated mass (the fewest blocks reaching gamma), where the code sizes a
top-k of blocks from the number of single columns or diagonals that reach gamma; every
cover keeps the block that crosses gamma; diagonal block d is the distances [d * block,
(d + 1) * block) at every length (the code's are shifted by the last block's padding when
the length is not a multiple of the block); the estimate uses the model's softmax scale;
the estimate masks the last block causally against a prefix of any length, so chunked
prefill works; the last `dense_tail` queries read densely; and selection is batched with no
host sync. On the same Q and K of a whole prompt the estimates and each head's pattern are
the code's, and the blocks a superset of its blocks at equal settings (docs/BENCHMARKS.md,
"Agreement with the authors' code").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from astream.ops import flexprefill as ops
from astream.ops.xattention import block_sparse_attention, visible_block_count, visible_mask
from astream.policies.base import KVLayout, SparsePolicy, check_int
from astream.policies.sparse_prefill import (
    SequencePrefillRuntime, prefill_counters, prefill_traits,
)


@dataclass(slots=True, frozen=True)
class FlexPrefillPolicy(SparsePolicy):
    gamma: float = 0.99
    tau: float = 0.1
    min_budget: int = 1024
    max_budget: int | None = None
    block_size: int = 128
    dense_tail: int = 128
    chunk_tokens: int = 32768
    name = "flexprefill"
    phase = "prefill"

    def __post_init__(self) -> None:
        check_int("FlexPrefillPolicy", "dense_tail", self.dense_tail, 0)
        check_int("FlexPrefillPolicy", "chunk_tokens", self.chunk_tokens, 0)
        for key in ("gamma", "tau"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"FlexPrefillPolicy {key} must be a number, got {value!r}")
        if not 0.0 < self.gamma <= 1.0:
            raise ValueError(f"FlexPrefillPolicy gamma must be in (0, 1], got {self.gamma!r}")
        if self.tau < 0.0:
            raise ValueError(f"FlexPrefillPolicy tau must be >= 0, got {self.tau!r}")
        check_int("FlexPrefillPolicy", "min_budget", self.min_budget, 0)
        check_int("FlexPrefillPolicy", "block_size", self.block_size, 16)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"FlexPrefillPolicy block_size must be a power of two >= 16, "
                             f"got {self.block_size}")
        if self.max_budget is not None:
            check_int("FlexPrefillPolicy", "max_budget", self.max_budget, max(1, self.min_budget))

    def prefill_chunk_tokens(self) -> int:
        return self.chunk_tokens

    def estimate(self, q: Tensor, k: Tensor, scale: float) -> tuple[ops.Estimate, Tensor]:
        """A chunk's last-block estimate and its query-aware block scores (both read the
        keys' block means: computed once, a pass over every key of the chunk's context)."""
        block = self.block_size
        key_means = ops.block_means(k, block)
        return (ops.last_block_estimate(q, k, block=block, scale=scale, key_means=key_means),
                ops.query_aware_scores(q, k, block=block, scale=scale, key_means=key_means))

    def select(self, est: ops.Estimate, qa_scores: Tensor, n_q: int, n_k: int) -> tuple[Tensor, Tensor]:
        """(block mask, query-aware heads) of a chunk of n_q queries over n_k keys, at this
        policy's settings."""
        block = self.block_size
        max_blocks = None if self.max_budget is None else ops.block_budget(self.max_budget, block)
        return ops.select_blocks(est, qa_scores, gamma=self.gamma, tau=self.tau,
                                 min_blocks=ops.block_budget(self.min_budget, block),
                                 max_blocks=max_blocks, n_q=n_q, n_k=n_k, block=block)

    def bind(self, layout: KVLayout) -> "FlexPrefillRuntime":
        heads = torch.zeros(layout.num_layers, 2, dtype=torch.int64, device=layout.device)
        return FlexPrefillRuntime(counters=prefill_counters(layout), traits=prefill_traits(layout),
                                  policy=self, heads=heads)


@dataclass(slots=True)
class FlexPrefillRuntime(SequencePrefillRuntime):
    policy: FlexPrefillPolicy         # counters: blocks kept, blocks causally visible
    heads: Tensor                     # [layers, 2]: query-aware head estimates, all of them

    def attend_sequence(self, layer: int, q: Tensor, k: Tensor, v: Tensor,
                        scale: float) -> tuple[Tensor, Tensor, Tensor, int]:
        block = self.policy.block_size
        mask = self._mask(layer, q, k, scale)
        out, lse = block_sparse_attention(q, k, v, mask, block=block, scale=scale)
        return out, lse, mask.sum(), visible_block_count(q.shape[0], k.shape[0], block) * q.shape[1]

    def _mask(self, layer: int, q: Tensor, k: Tensor, scale: float) -> Tensor:
        policy, block = self.policy, self.policy.block_size
        n_q, n_k = q.shape[0], k.shape[0]
        if policy.gamma >= 1.0:           # exact: every visible block, nothing to estimate
            return visible_mask(q.shape[1], n_q, n_k, block, q.device)
        mask, query_aware = policy.select(*policy.estimate(q, k, scale), n_q, n_k)
        self.heads[layer, 0] += query_aware.sum()
        self.heads[layer, 1] += query_aware.numel()
        return mask

    def stats(self) -> dict:
        """Share of the causally visible key blocks prefill read, by layer, the totals (blocks
        read, blocks visible) over every layer, and per layer the share of head estimates
        that chose the query-aware pattern."""
        aware, total = self.heads.cpu().unbind(1)
        return {**self.density_stats("flexprefill_density", "flexprefill_blocks"),
                "flexprefill_query_aware": [round(a / t, 4) if t else None
                                            for a, t in zip(aware.tolist(), total.tolist())]}
