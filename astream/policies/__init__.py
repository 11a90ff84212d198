"""Sparse attention policies: which KV a query reads (see policies/base.py for the seam)."""

from __future__ import annotations

from astream.policies.base import DecodeQuery, KVLayout, PageSelection, PolicyRuntime, SparsePolicy
from astream.policies.full import FullPolicy
from astream.policies.quest import QuestPolicy, QuestRuntime
from astream.policies.xattention import XAttentionPolicy

POLICIES: dict[str, type[SparsePolicy]] = {"full": FullPolicy, "quest": QuestPolicy,
                                            "xattention": XAttentionPolicy}


def make_policy(spec: str | SparsePolicy, budget_tokens: int | None = None, *,
                offload: bool = False) -> SparsePolicy:
    """The policy an engine option names, or the instance it is. A budget applies to a policy
    given by name. Unknown names, bad parameters and a policy that cannot run with offload
    (when `offload`) raise ValueError naming them."""
    policy = _named_policy(spec, budget_tokens)
    if offload and not policy.supports_offload:
        raise ValueError(f"sparse_policy {policy.name!r} does not work with offload yet")
    return policy


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
    if "budget_tokens" not in getattr(cls, "__dataclass_fields__", {}):
        raise ValueError(f"sparse policy {spec!r} takes no budget (sparse_budget)")
    return cls(budget_tokens=budget_tokens)


__all__ = ["DecodeQuery", "FullPolicy", "KVLayout", "POLICIES", "PageSelection", "PolicyRuntime",
           "QuestPolicy", "QuestRuntime", "SparsePolicy", "XAttentionPolicy", "make_policy"]
