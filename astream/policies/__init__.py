"""Sparse attention policies: which KV a query reads (see policies/base.py for the seam)."""

from __future__ import annotations

from astream.policies.base import DecodeQuery, KVLayout, PageSelection, PolicyRuntime, SparsePolicy
from astream.policies.combined import CombinedPolicy
from astream.policies.full import FullPolicy
from astream.policies.minference import MInferencePolicy
from astream.policies.quest import QuestPolicy, QuestRuntime
from astream.policies.xattention import XAttentionPolicy

POLICIES: dict[str, type[SparsePolicy]] = {"full": FullPolicy, "quest": QuestPolicy,
                                            "xattention": XAttentionPolicy,
                                            "minference": MInferencePolicy}


def make_policy(spec: str | SparsePolicy, budget_tokens: int | None = None) -> SparsePolicy:
    """The policy an engine option names, or the instance it is. A budget applies to a policy
    given by name. "prefill+decode" names combine a prefill policy with a decode policy
    (e.g. "xattention+quest"; the budget goes to the part that takes one). Unknown names
    and bad parameters raise ValueError naming them. Every policy runs resident and with
    offload."""
    if isinstance(spec, str) and "+" in spec:
        return _combined_policy(spec, budget_tokens)
    return _named_policy(spec, budget_tokens)


def _combined_policy(spec: str, budget_tokens: int | None) -> CombinedPolicy:
    names = [name.strip() for name in spec.split("+")]
    if len(names) != 2:
        raise ValueError(f"sparse_policy {spec!r}: combine exactly two policies, a prefill and "
                         "a decode one (e.g. 'xattention+quest')")
    classes = [POLICIES.get(name) for name in names]
    if None in classes:
        return _named_policy(names[classes.index(None)], None)        # raises: unknown name
    takes = [name for name, cls in zip(names, classes) if _takes_budget(cls)]
    if budget_tokens is not None and not takes:
        raise ValueError(f"sparse policy {spec!r} takes no budget (sparse_budget)")
    parts = {cls.phase: _named_policy(name, budget_tokens if name in takes else None)
             for name, cls in zip(names, classes)}
    if set(parts) != {"prefill", "decode"}:
        raise ValueError(f"sparse_policy {spec!r}: combine one prefill policy "
                         f"({', '.join(phase_policies('prefill'))}) with one decode policy "
                         f"({', '.join(phase_policies('decode'))})")
    return CombinedPolicy(prefill=parts["prefill"], decode=parts["decode"])


def phase_policies(phase: str) -> list[str]:
    """Names of the policies that make `phase` ("prefill" or "decode") sparse."""
    return [name for name, cls in POLICIES.items() if cls.phase == phase]


def _takes_budget(cls: type[SparsePolicy]) -> bool:
    return "budget_tokens" in getattr(cls, "__dataclass_fields__", {})


def _named_policy(spec: str | SparsePolicy, budget_tokens: int | None) -> SparsePolicy:
    if isinstance(spec, SparsePolicy):
        if budget_tokens is not None:
            raise ValueError("sparse_budget applies to a policy given by name; a SparsePolicy "
                             "instance carries its own parameters")
        return spec
    if not isinstance(spec, str) or spec not in POLICIES:
        raise ValueError(f"unknown sparse_policy {spec!r}; use one of {sorted(POLICIES)} "
                         "or a SparsePolicy instance")
    cls = POLICIES[spec]
    if budget_tokens is None:
        return cls()
    if not _takes_budget(cls):
        raise ValueError(f"sparse policy {spec!r} takes no budget (sparse_budget)")
    return cls(budget_tokens=budget_tokens)


__all__ = ["CombinedPolicy", "DecodeQuery", "FullPolicy", "KVLayout", "MInferencePolicy", "POLICIES",
           "PageSelection", "PolicyRuntime", "QuestPolicy", "QuestRuntime", "SparsePolicy",
           "XAttentionPolicy", "make_policy"]
