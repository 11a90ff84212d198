"""Full attention: every block, every token. The exact baseline."""

from __future__ import annotations

from dataclasses import dataclass

from astream.policies.base import SparsePolicy


@dataclass(slots=True, frozen=True)
class FullPolicy(SparsePolicy):
    name = "full"
