"""Sparse attention policies: which KV a query reads (see policies/base.py for the seam)."""

from __future__ import annotations

from astream.policies.base import (
    DecodeQuery, HostPages, KVLayout, PageSelection, PolicyRuntime, PolicyTraits, PrefetchedPages,
    SparsePolicy, StepPlan, StepShape,
)
from astream.policies.combined import CombinedPolicy
from astream.policies.flexprefill import FlexPrefillPolicy
from astream.policies.full import FullPolicy
from astream.policies.minference import MInferencePolicy
from astream.policies.quest import QuestPolicy, QuestRuntime
from astream.policies.spec import parse_policy_spec
from astream.policies.window import WindowPolicy
from astream.policies.xattention import XAttentionPolicy

POLICIES: dict[str, type[SparsePolicy]] = {"full": FullPolicy, "quest": QuestPolicy,
                                            "xattention": XAttentionPolicy,
                                            "minference": MInferencePolicy,
                                            "flexprefill": FlexPrefillPolicy, "window": WindowPolicy}


def make_policy(spec: str | SparsePolicy, budget_tokens: int | None = None) -> SparsePolicy:
    """The policy an engine option names, or the instance it is. A name may carry
    parameters ("minference(vertical_size=4000, slash_size=24384)"), and a budget applies
    to a policy given by name. "prefill+decode" names combine a prefill policy with a
    decode policy (e.g. "xattention+quest"; the budget goes to the part that takes one).
    Unknown names and bad parameters raise ValueError naming them. Every policy runs
    resident and with offload."""
    if isinstance(spec, SparsePolicy):
        if budget_tokens is not None:
            raise ValueError("sparse_budget applies to a policy given by name; a SparsePolicy "
                             "instance carries its own parameters")
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"sparse_policy must be a policy name or a SparsePolicy instance, got {spec!r}")
    parts = parse_policy_spec(spec)
    if len(parts) == 1:
        return _named_policy(spec, *parts[0], budget_tokens)
    return _combined_policy(spec, parts, budget_tokens)


def check_policy_mode(policy: SparsePolicy, offload: bool) -> None:
    """Options that only mean something with offload raise without it, rather than do nothing."""
    if not offload and policy.decode_buffer_tokens():
        raise ValueError(f"sparse policy {policy.name}: reuse_pages and prefetch keep pages of an "
                         "offloaded cache on the device; they need offload=True")
    if not offload and policy.keeps_keys_on_device:
        raise ValueError(f"sparse policy {policy.name}: keys_on_device keeps a device copy of an "
                         "offloaded cache's keys; it needs offload=True")


def _combined_policy(spec: str, parts: list[tuple[str, dict]], budget_tokens: int | None) -> CombinedPolicy:
    if len(parts) != 2:
        raise ValueError(f"sparse_policy {spec!r}: combine exactly two policies, a prefill and "
                         "a decode one (e.g. 'xattention+quest')")
    for name, _ in parts:
        _policy_class(spec, name)                                  # raises: unknown name
    takes = [name for name, _ in parts if _takes_budget(POLICIES[name])]
    if budget_tokens is not None and not takes:
        raise ValueError(f"sparse policy {spec!r} takes no budget (sparse_budget)")
    built = {POLICIES[name].phase: _named_policy(spec, name, params,
                                                 budget_tokens if name in takes else None)
             for name, params in parts}
    if set(built) != {"prefill", "decode"}:
        raise ValueError(f"sparse_policy {spec!r}: combine one prefill policy "
                         f"({', '.join(phase_policies('prefill'))}) with one decode policy "
                         f"({', '.join(phase_policies('decode'))})")
    return CombinedPolicy(prefill=built["prefill"], decode=built["decode"])


def phase_policies(phase: str) -> list[str]:
    """Names of the policies that make `phase` ("prefill" or "decode") sparse."""
    return [name for name, cls in POLICIES.items() if cls.phase == phase]


def _takes_budget(cls: type[SparsePolicy]) -> bool:
    return "budget_tokens" in getattr(cls, "__dataclass_fields__", {})


def _policy_class(spec: str, name: str) -> type[SparsePolicy]:
    if name not in POLICIES:
        raise ValueError(f"unknown sparse_policy {name!r}" + (f" in {spec!r}" if spec != name else "")
                         + f"; use one of {sorted(POLICIES)} or a SparsePolicy instance")
    return POLICIES[name]


def _named_policy(spec: str, name: str, params: dict, budget_tokens: int | None) -> SparsePolicy:
    cls = _policy_class(spec, name)
    fields = getattr(cls, "__dataclass_fields__", {})
    unknown = sorted(set(params) - set(fields))
    if unknown:
        known = ", ".join(sorted(fields)) or "none"
        raise ValueError(f"sparse_policy {spec!r}: {name} has no parameter {unknown[0]!r} "
                         f"(its parameters: {known})")
    if budget_tokens is not None:
        if not _takes_budget(cls):
            raise ValueError(f"sparse policy {spec!r} takes no budget (sparse_budget)")
        if "budget_tokens" in params:
            raise ValueError(f"sparse_policy {spec!r}: give the budget once, as budget_tokens= "
                             "or as sparse_budget")
        params = {**params, "budget_tokens": budget_tokens}
    try:
        return cls(**params)
    except TypeError as exc:         # e.g. a field the constructor does not take
        raise ValueError(f"sparse_policy {spec!r}: {exc}") from None


__all__ = ["CombinedPolicy", "DecodeQuery", "FlexPrefillPolicy", "FullPolicy", "HostPages", "KVLayout",
           "MInferencePolicy", "POLICIES", "PageSelection", "PolicyRuntime", "PolicyTraits", "PrefetchedPages",
           "QuestPolicy", "QuestRuntime", "SparsePolicy", "StepPlan", "StepShape", "WindowPolicy",
           "XAttentionPolicy", "check_policy_mode", "make_policy"]
