"""Quest's page reuse plan (policies.quest.page_reuse) against a model of the slots kept in Python."""

from __future__ import annotations

import random

import pytest
import torch

from astream.policies.quest.page_reuse import plan_reuse, plan_reuse_
from triton_interpreter import run_interpreted_check


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


def random_plan_steps(seed: int, rows: int, heads: int, width: int, pages: int, steps: int):
    """(want, counts, owners) of consecutive steps: distinct wanted pages drawn from a small
    range (so steps overlap), padded by repeating the last; rows change owner now and then."""
    rng = random.Random(seed)
    epochs = list(range(rows))
    for step in range(steps):
        if step % 5 == 4:
            epochs[rng.randrange(rows)] += rows
        counts = torch.tensor([[rng.randint(0, width) for _ in range(heads)] for _ in range(rows)],
                              dtype=torch.int32)
        want = torch.zeros(rows, heads, width, dtype=torch.int64)
        for r in range(rows):
            for h in range(heads):
                chosen = sorted(rng.sample(range(pages), int(counts[r, h])))
                want[r, h, :len(chosen)] = torch.tensor(chosen, dtype=torch.int64)
                want[r, h, len(chosen):] = chosen[-1] if chosen else 0
        yield want, counts, torch.tensor(epochs, dtype=torch.int64)


def check_triton_plan(device: str) -> int:
    """The Triton plan against the torch one, step after step from the state each leaves.
    A case with more slots than its width alternates, as Quest's prefetch does, plans as
    wide as the slots (the prediction) with plans of the width (the layer's own choice)."""
    from astream.ops.triton_page_reuse import plan_reuse_triton
    cases = [(3, 2, 6, 12, 30, 6), (2, 4, 40, 120, 12, 40), (1, 2, 272, 2048, 6, 272),
             (4, 1, 300, 400, 6, 300), (2, 3, 20, 90, 16, 30), (1, 2, 256, 2048, 8, 384),
             (1, 1, 2100, 4000, 3, 2100)]     # the misses' ranks carry across wide tiles
    for seed, (rows, heads, width, pages, steps, slots) in enumerate(cases):
        held = torch.full((rows, heads, slots), -1, dtype=torch.int64)
        owner = torch.full((rows, heads), -1, dtype=torch.int64)
        held_dev, owner_dev = held.to(device, copy=True), owner.to(device, copy=True)
        loaded, loaded_dev = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64, device=device)
        wide = random_plan_steps(seed + 100, rows, heads, slots, pages, steps)
        narrow = random_plan_steps(seed, rows, heads, width, pages, steps)
        plans = (plan for pair in zip(wide, narrow) for plan in pair) if slots > width else narrow
        for want, counts, owners in plans:
            page_list, load_to = plan_reuse_(held, owner, want, counts, owners, loaded)
            got = plan_reuse_triton(held_dev, owner_dev, want.to(device), counts.to(device),
                                    owners.to(device), loaded_dev)
            assert torch.equal(got[0].cpu(), page_list) and torch.equal(got[1].cpu(), load_to)
            assert torch.equal(held_dev.cpu(), held) and torch.equal(owner_dev.cpu(), owner)
            assert torch.equal(loaded_dev.cpu(), loaded)
        assert int(loaded) > 0
    return len(cases)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the compiled kernel is tested")
def test_triton_plan_interpreter_matches_reference():
    assert run_interpreted_check("test_page_reuse", "check_triton_plan") == 7


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_plan_on_gpu_matches_reference():
    assert check_triton_plan("cuda") == 7


def test_plan_in_place_keeps_state_for_the_next_step():
    held = torch.full((1, 1, 4), -1, dtype=torch.int64)
    owner = torch.full((1, 1), -1, dtype=torch.int64)
    loaded = torch.zeros(1, dtype=torch.int64)
    owners = torch.tensor([7])
    plan_reuse_(held, owner, torch.tensor([[[3, 5, 5, 5]]]), torch.tensor([[2]]), owners, loaded)
    page_list, load_to = plan_reuse_(held, owner, torch.tensor([[[1, 5, 9, 9]]]),
                                     torch.tensor([[3]]), owners, loaded)
    assert owner.tolist() == [[7]] and int(loaded) == 4      # 3, 5, then 1 and 9
    assert int(page_list[0, 0, 1]) == 1 and int(load_to[0, 0, 1]) == -1   # 5 stays in slot 1
    assert held[0, 0].tolist() == [1, 5, 9, -1]     # free slots go in order: 3 made way
