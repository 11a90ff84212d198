"""Sparse attention policies: which KV blocks attention reads."""

from __future__ import annotations

from astream.policies.base import BlockOffload, PolicyContext, SparsePolicy
from astream.policies.full import FullPolicy

POLICIES = {"full": FullPolicy}


def make_policy(name: str | SparsePolicy) -> SparsePolicy:
    if isinstance(name, SparsePolicy):
        return name
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown sparse policy {name!r}; available: {', '.join(POLICIES)}") from None


__all__ = ["BlockOffload", "FullPolicy", "POLICIES", "PolicyContext", "SparsePolicy", "make_policy"]
