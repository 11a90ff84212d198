"""Command-line values of an evaluation: lengths, depths, task lists and --compare specs."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from astream.base.config import canonical_kv_dtype
from astream.policies import make_policy
from astream.policies.spec import split_top_level

_LENGTH = re.compile(r"(\d+)([kK]?)")
_PART = re.compile(r"([A-Za-z][\w-]*(?:\s*\([^()]*\))?)(?::(\d+))?")


@dataclass(slots=True, frozen=True)
class EvalConfig:
    """One engine configuration of a comparison: a name and the engine options it sets."""

    name: str
    engine_kwargs: dict = field(default_factory=dict)

    @property
    def budget(self) -> int | None:
        return self.engine_kwargs.get("sparse_budget")


def parse_lengths(text: str) -> list[int]:
    """'1K,4096,32K' -> [1024, 4096, 32768] (K = 1024)."""
    lengths = []
    for item in _items(text, "lengths"):
        match = _LENGTH.fullmatch(item)
        if not match or int(match[1]) == 0:
            raise ValueError(f"bad length {item!r}: use a positive number of tokens such as 4096 or 4K")
        lengths.append(int(match[1]) * (1024 if match[2] else 1))
    return lengths


def parse_depths(text: str) -> list[float]:
    """'0.1,0.5,0.9' -> [0.1, 0.5, 0.9]; each depth in [0, 1]."""
    depths = []
    for item in _items(text, "depths"):
        try:
            depth = float(item)
        except ValueError:
            raise ValueError(f"bad depth {item!r}: use a number in [0, 1] such as 0.5") from None
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"bad depth {item!r}: it must be in [0, 1]")
        depths.append(depth)
    return depths


def parse_names(text: str, known: tuple[str, ...], what: str) -> list[str]:
    names = _items(text, what)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; choose from {', '.join(known)}")
    return names


def parse_configs(text: str) -> list[EvalConfig]:
    """A --compare spec: items separated by commas, each item parts joined by '+'.

    A part is 'offload' (offload=True), a KV cache dtype ('fp8', 'fp8_e5m2', 'bfloat16':
    kv_cache_dtype), or a sparse policy name, with optional parameters in parentheses and an
    optional ':N' budget (sparse_policy=name, sparse_budget=N); two policy parts combine a
    prefill and a decode policy ('xattention(threshold=0.95)+quest:2048'). Every item sets
    sparse_policy ('full' unless a part names one) and offload (False unless a part says
    'offload'), so 'full' is the plain baseline and 'fp8' the same with fp8 KV. Policy
    names and budgets are checked here, before any engine is built.
    """
    configs = [_parse_item(item) for item in _items(text, "--compare", split_top_level)]
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"--compare {text!r} names a configuration twice")
    return configs


def _parse_item(item: str) -> EvalConfig:
    kwargs: dict = {"sparse_policy": "full", "offload": False}
    policies: list[str] = []
    for part in split_top_level(item, "+"):
        part = part.strip()
        if part == "offload":
            if kwargs["offload"]:
                raise ValueError(f"bad --compare item {item!r}: 'offload' is given twice")
            kwargs["offload"] = True
            continue
        kv_dtype = _kv_dtype(part)
        if kv_dtype is not None:
            if "kv_cache_dtype" in kwargs:
                raise ValueError(f"bad --compare item {item!r}: give one KV cache dtype")
            kwargs["kv_cache_dtype"] = kv_dtype
            continue
        match = _PART.fullmatch(part)
        if not match:
            raise ValueError(f"bad --compare item {item!r}: {part!r} is neither 'offload' nor a policy "
                             "name with optional parameters and ':N' budget (e.g. 'quest:1024', "
                             "'xattention(threshold=0.95)')")
        policies.append(match[1])
        if match[2] is not None:
            if int(match[2]) < 1 or "sparse_budget" in kwargs:
                raise ValueError(f"bad --compare item {item!r}: give one budget, a positive integer")
            kwargs["sparse_budget"] = int(match[2])
    if policies:
        kwargs["sparse_policy"] = "+".join(policies)
    try:
        make_policy(kwargs["sparse_policy"], kwargs.get("sparse_budget"))
    except ValueError as exc:
        raise ValueError(f"bad --compare item {item!r}: {exc}") from None
    return EvalConfig(item.replace(" ", ""), kwargs)


def _kv_dtype(part: str) -> str | None:
    """The kv_cache_dtype a --compare part names ('auto' is not a part), or None."""
    try:
        canonical = canonical_kv_dtype(part)
    except ValueError:
        return None
    return None if canonical == "auto" else canonical


def _items(text: str, what: str, split=str.split) -> list[str]:
    try:
        items = [item.strip() for item in split(text, ",")]
    except ValueError as exc:            # unbalanced parentheses
        raise ValueError(f"bad {what} {exc}") from None
    if not text.strip() or any(not item for item in items):
        raise ValueError(f"bad {what} {text!r}: give a comma-separated list with no empty items")
    return items
