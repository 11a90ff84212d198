"""Quest, query-aware decode page selection: the policy and its runtime (policy.py), and
the selected pages kept on the device between offloaded steps (page_reuse.py). Its
kernels are in ops/ (quest.py: page bounds; quest_select.py: the selection)."""

from __future__ import annotations

from astream.policies.quest.policy import QuestPolicy, QuestRuntime

__all__ = ["QuestPolicy", "QuestRuntime"]
