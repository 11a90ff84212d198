"""Quest's page reuse plan (kvcache.page_reuse) against a model of the slots kept in Python."""

from __future__ import annotations

import random

import torch

from astream.kvcache.page_reuse import plan_reuse


def test_plan_keeps_hits_in_place_and_loads_each_miss_into_a_free_slot():
    rng = random.Random(0)
    rows, heads, width = 3, 2, 6
    held = torch.full((rows, heads, width), -1, dtype=torch.int64)
    owner = torch.full((rows, heads), -1, dtype=torch.int64)
    model = [[{} for _ in range(heads)] for _ in range(rows)]    # slot -> page, per row and head
    epochs = [1, 2, 3]
    for step in range(40):
        if step % 7 == 6:
            epochs[rng.randrange(rows)] += 10                    # a row's sequence changes
        counts = torch.tensor([[rng.randint(0, width) for _ in range(heads)] for _ in range(rows)])
        want = torch.zeros(rows, heads, width, dtype=torch.int64)
        for r in range(rows):
            for h in range(heads):
                pages = rng.sample(range(12), int(counts[r, h]))  # distinct; overlap step to step
                want[r, h, :len(pages)] = torch.tensor(pages, dtype=torch.int64)
                want[r, h, len(pages):] = pages[-1] if pages else 0   # padding repeats the last
        owners = torch.tensor(epochs)
        plan = plan_reuse(held, owner, want, counts, owners)
        loads = 0
        for r in range(rows):
            for h in range(heads):
                before = {} if int(owner[r, h]) != epochs[r] else model[r][h]
                where = {page: slot for slot, page in before.items()}
                n = int(counts[r, h])
                slots = plan.page_list[r, h, :n].tolist()
                assert len(set(slots)) == n                       # distinct slots
                for i in range(n):
                    page, slot, load = int(want[r, h, i]), slots[i], int(plan.load_to[r, h, i])
                    if page in where:                             # a hit stays where it was
                        assert slot == where[page] and load == -1
                    else:
                        assert load == slot and slot not in {where[p] for p in where
                                                             if p in want[r, h, :n].tolist()}
                        loads += 1
                assert all(int(x) == -1 for x in plan.load_to[r, h, n:])
                after = {s: p for s, p in before.items()}
                after.update({slots[i]: int(want[r, h, i]) for i in range(n)})
                model[r][h] = after
                assert {s: p for s, p in enumerate(plan.held[r, h].tolist()) if p >= 0} == after
        assert int(plan.loads) == loads
        held, owner = plan.held, owners.unsqueeze(-1).expand(rows, heads).clone()


def test_a_new_owner_starts_with_empty_slots():
    held = torch.tensor([[[5, 6, 7]]])
    want = torch.tensor([[[5, 6, 7]]])
    counts = torch.tensor([[3]])
    same = plan_reuse(held, torch.tensor([[4]]), want, counts, torch.tensor([4]))
    other = plan_reuse(held, torch.tensor([[4]]), want, counts, torch.tensor([9]))
    assert int(same.loads) == 0 and same.load_to.tolist() == [[[-1, -1, -1]]]
    assert int(other.loads) == 3 and sorted(other.load_to[0, 0].tolist()) == [0, 1, 2]
