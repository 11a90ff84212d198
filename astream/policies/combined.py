"""One policy for prefill and another for decode in one engine, e.g. XAttention + Quest.

Each part keeps its own runtime and metadata; the combination routes every hook to the
part whose phase it is: prefill overrides to the prefill policy, decode selection to the
decode policy, and written keys to both (Quest keeps its page bounds current during a
sparse prefill).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from astream.ops.varlen import VarlenMeta
from astream.policies.base import DecodeQuery, KVLayout, PageSelection, PolicyRuntime, SparsePolicy


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

    def decode_buffer_tokens(self) -> int:
        return self.decode.decode_buffer_tokens()

    def bind(self, layout: KVLayout) -> "CombinedRuntime":
        return CombinedRuntime(self.prefill.bind(layout), self.decode.bind(layout))


@dataclass(slots=True)
class CombinedRuntime(PolicyRuntime):
    prefill: PolicyRuntime
    decode: PolicyRuntime

    def on_kv_written(self, layer: int, keys: Tensor, slots: Tensor) -> None:
        self.prefill.on_kv_written(layer, keys, slots)
        self.decode.on_kv_written(layer, keys, slots)

    def watches_keys(self) -> bool:
        return self.prefill.watches_keys() or self.decode.watches_keys()

    def selects_decode(self, layer: int, max_context: int) -> bool:
        return self.decode.selects_decode(layer, max_context)

    def may_select_decode(self) -> bool:
        return self.decode.may_select_decode()

    def reuses_decode_pages(self) -> bool:
        return self.decode.reuses_decode_pages()

    def replaces_prefill(self, layer: int) -> bool:
        return self.prefill.replaces_prefill(layer)

    def select_decode(self, layer: int, query: DecodeQuery) -> PageSelection:
        return self.decode.select_decode(layer, query)

    def prefill_attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta: VarlenMeta,
                          causal: bool, scale: float) -> tuple[Tensor, Tensor] | None:
        return self.prefill.prefill_attention(layer, q, k, v, meta, causal, scale)

    def stats(self) -> dict:
        return {**self.prefill.stats(), **self.decode.stats()}

