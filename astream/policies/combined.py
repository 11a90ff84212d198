"""One policy for prefill and another for decode in one engine, e.g. XAttention + Quest.

Each part keeps its own runtime and metadata; the combination declares the prefill part's
prefill layers and the decode part's decode traits, and routes every hook to the part
whose phase it is: prefill overrides to the prefill policy, step plans, decode selection
and page loads to the decode policy, and written keys to both (Quest keeps its page
bounds current during a sparse prefill).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from astream.ops.varlen import VarlenMeta
from astream.policies.base import (
    DecodeQuery, HostPages, KVLayout, PageSelection, PolicyRuntime, PolicyTraits, PrefetchedPages,
    SparsePolicy, StepPlan, StepShape,
)


@dataclass(slots=True, frozen=True)
class CombinedPolicy(SparsePolicy):
    prefill: SparsePolicy
    decode: SparsePolicy

    def __post_init__(self) -> None:
        for part, phase in ((self.prefill, "prefill"), (self.decode, "decode")):
            if not isinstance(part, SparsePolicy) or part.phase != phase:
                raise ValueError(f"CombinedPolicy {phase} must be a {phase} policy (a SparsePolicy "
                                 f"whose phase is {phase!r}), got {part!r}")

    @property
    def name(self) -> str:
        return f"{self.prefill.name}+{self.decode.name}"

    @property
    def sparse_prefill(self) -> bool:
        return True

    def kv_overhead(self, num_layers: int, block_size: int = 0) -> float:
        return (self.prefill.kv_overhead(num_layers, block_size)
                + self.decode.kv_overhead(num_layers, block_size))

    def offload_device_layers(self, num_layers: int) -> tuple[int, ...]:
        return self.decode.offload_device_layers(num_layers)

    @property
    def keeps_keys_on_device(self) -> bool:
        return self.decode.keeps_keys_on_device

    def offload_key_layers(self, num_layers: int) -> tuple[int, ...]:
        return self.decode.offload_key_layers(num_layers)

    def decode_buffer_tokens(self, max_context: int | None = None) -> int:
        return self.decode.decode_buffer_tokens(max_context)

    def decode_scratch_bytes(self, *, num_heads: int, num_kv_heads: int, head_dim: int, rows: int,
                             max_context: int, block_size: int) -> int:
        return self.decode.decode_scratch_bytes(
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, rows=rows,
            max_context=max_context, block_size=block_size)

    def prefill_chunk_tokens(self) -> int:
        return self.prefill.prefill_chunk_tokens()

    def bind(self, layout: KVLayout) -> "CombinedRuntime":
        prefill, decode = self.prefill.bind(layout), self.decode.bind(layout)
        traits = PolicyTraits(
            watches_keys=prefill.traits.watches_keys or decode.traits.watches_keys,
            decode_layers=decode.traits.decode_layers, select_above=decode.traits.select_above,
            loads_pages=decode.traits.loads_pages, prefetches=decode.traits.prefetches,
            prefill_layers=prefill.traits.prefill_layers,
            device_layers=decode.traits.device_layers)
        return CombinedRuntime(prefill, decode, traits=traits)


@dataclass(slots=True)
class CombinedRuntime(PolicyRuntime):
    prefill: PolicyRuntime
    decode: PolicyRuntime

    def plan_step(self, shape: StepShape) -> StepPlan:
        return self.decode.plan_step(shape)

    def on_kv_written(self, layer: int, keys: Tensor, slots: Tensor) -> None:
        self.prefill.on_kv_written(layer, keys, slots)
        self.decode.on_kv_written(layer, keys, slots)

    def select_decode(self, layer: int, query: DecodeQuery) -> PageSelection:
        return self.decode.select_decode(layer, query)

    def load_pages(self, layer: int, chosen: PageSelection, pool: HostPages,
                   owners: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
        return self.decode.load_pages(layer, chosen, pool, owners)

    def prefetch_pages(self, layer: int, query: DecodeQuery, pool: HostPages,
                       owners: Tensor) -> PrefetchedPages | None:
        return self.decode.prefetch_pages(layer, query, pool, owners)

    def prefill_attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta: VarlenMeta,
                          causal: bool, scale: float) -> tuple[Tensor, Tensor] | None:
        return self.prefill.prefill_attention(layer, q, k, v, meta, causal, scale)

    def stats(self) -> dict:
        return {**self.prefill.stats(), **self.decode.stats()}
