"""What the sparse prefill methods share: each replaces the causal attention of every
sequence's prefill chunk (over its prefix and itself) and counts what it read.

Each policy's `dense_tail` last queries of a chunk read every key they can see, exactly:
the end of a prompt (a question, an instruction) is what its first output token is computed
from, and there an estimate that drops the one block holding a fact loses the answer. At
128K it costs `dense_tail` rows of full attention per chunk, a fraction of a percent of the
chunk's dense work. The density counters count what the estimate kept, not the tail.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from astream.ops.attention import varlen_attention
from astream.ops.varlen import VarlenMeta
from astream.policies.base import KVLayout, PolicyRuntime, PolicyTraits


def prefill_counters(layout: KVLayout) -> Tensor:
    """[layers, 2] device counters: what prefill read, what it could see."""
    return torch.zeros(layout.num_layers, 2, dtype=torch.int64, device=layout.device)


def prefill_traits(layout: KVLayout) -> PolicyTraits:
    """Every layer's prefill attention replaced; decode and written keys left alone."""
    return PolicyTraits(prefill_layers=frozenset(range(layout.num_layers)))


@dataclass(slots=True)
class SequencePrefillRuntime(PolicyRuntime):
    """Subclasses give `attend_sequence` for one sequence's chunk and hold their policy as the
    field `policy` (its `dense_tail` is read here); non-causal parts (slices of a prefix) are
    left to the engine's kernel."""

    counters: Tensor                  # [layers, 2]: what prefill read, what it could see

    def attend_sequence(self, layer: int, q: Tensor, k: Tensor, v: Tensor,
                        scale: float) -> tuple[Tensor, Tensor, Tensor, int]:
        """(out, lse, read: a device count, visible: a host count) for one chunk."""
        raise NotImplementedError

    def prefill_attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta: VarlenMeta,
                          causal: bool, scale: float) -> tuple[Tensor, Tensor] | None:
        if not causal:
            return None
        out = torch.empty_like(q)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        cq, ck = meta.host_cu_seqlens_q, meta.host_cu_seqlens_k
        for seq in range(len(cq) - 1):
            q0, q1, k0, k1 = cq[seq], cq[seq + 1], ck[seq], ck[seq + 1]
            if q1 == q0:
                continue
            out[q0:q1], lse[q0:q1], read, visible = self.attend_sequence(
                layer, q[q0:q1], k[k0:k1], v[k0:k1], scale)
            self.counters[layer, 0] += read
            self.counters[layer, 1] += visible
            tail = min(self.policy.dense_tail, q1 - q0)
            if tail:
                out[q1 - tail:q1], lse[q1 - tail:q1] = _dense_rows(
                    q[q1 - tail:q1], k[k0:k1], v[k0:k1], scale)
        return out, lse

    def density_stats(self, name: str, totals: str) -> dict:
        """`name`: per layer, the share of what prefill could see that it read; `totals`:
        (read, visible) over every layer."""
        read, visible = self.counters.cpu().unbind(1)
        return {name: [round(r / v, 4) if v else None for r, v in zip(read.tolist(), visible.tolist())],
                totals: [int(read.sum()), int(visible.sum())]}


def _dense_rows(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Exact causal attention of a chunk's last len(q) queries over its keys k/v (the last
    len(q) keys are theirs: bottom-right alignment)."""
    meta = VarlenMeta.single(q.shape[0], k.shape[0], q.device)
    return varlen_attention(q, k, v, meta, causal=True, scale=scale)
