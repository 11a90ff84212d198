"""Full attention: every block, every token. The exact baseline."""

from __future__ import annotations

from astream.policies.base import SparsePolicy


class FullPolicy(SparsePolicy):
    name = "full"
