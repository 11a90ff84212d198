"""Sparse attention policies: which KV blocks attention reads."""

from __future__ import annotations

from astream.policies.base import BlockOffload, PolicyContext, SparsePolicy
from astream.policies.full import FullPolicy

POLICIES = {"full": FullPolicy}


def make_policy(name: str | SparsePolicy) -> SparsePolicy:
    """The policy an engine option names (or the instance it is). Unknown names raise
    ValueError listing the known ones."""
    if isinstance(name, SparsePolicy):
        return name
    if not isinstance(name, str) or name not in POLICIES:
        raise ValueError(f"unknown sparse_policy {name!r}; use one of {sorted(POLICIES)} "
                         "or a SparsePolicy instance")
    return POLICIES[name]()


__all__ = ["BlockOffload", "FullPolicy", "POLICIES", "PolicyContext", "SparsePolicy", "make_policy"]
