"""The latency of Quest's page reuse plan (astream.ops.triton_page_reuse), a kernel a layer
that sits between an offloaded layer's selection and its load, so its latency adds to the
chain that bounds the step.

    python benchmarks/run.py reuse_plan [--shapes 1x8x256x256,4x8x256x256] [--repeats 3]
    python benchmarks/run.py reuse_plan --against OTHER.py    # another plan_reuse_triton too
    python benchmarks/run.py reuse_plan --smoke                # CPU, the torch reference

A shape is ROWSxKV_HEADSxWIDTHxSLOTS: decode rows, KV heads, wanted pages a row and head
(Quest's budget in pages, or the prediction's F x budget), and slots a buffer keeps. A
CUDA graph of --plans [50] plans, each with fresh wanted pages drawn from --pages [8192]
(so few repeat, as on random weights: the plan's work hardly depends on how many do), is
replayed 5 times a repeat; the figure is microseconds a plan. With --against FILE, a Python
file defining `plan_reuse_triton` with the same signature (say, an earlier version:
`git show REV:astream/ops/triton_page_reuse.py > /tmp/other.py`) is timed beside this
tree's, and every row checks that both give the same plans and the same slot state over
six steps of overlapping choices.
"""

from __future__ import annotations

import importlib.util
from functools import partial

import torch

from common import cuda_times_ms  # noqa: I001
from quest import wall_us
from astream.policies.quest.page_reuse import plan_reuse_

REPLAYS = 5


def add_arguments(parser) -> None:
    parser.add_argument("--shapes", default=None,
                        help="ROWSxKV_HEADSxWIDTHxSLOTS cases "
                             "[1x8x256x256,4x8x256x256,1x8x256x384,4x8x384x384,1x8x2048x2048]")
    parser.add_argument("--plans", type=int, default=None, help="plans a graph [50]")
    parser.add_argument("--pages", type=int, default=8192,
                        help="pages the choices come from [8192]")
    parser.add_argument("--against", default=None,
                        help="a .py file with another plan_reuse_triton, timed and checked beside")


def cases(o):
    smoke = o.smoke or o.device == "cpu"
    o.shapes = o.shapes or ("1x2x16x24" if smoke else
                            "1x8x256x256,4x8x256x256,1x8x256x384,4x8x384x384,1x8x2048x2048")
    o.plans = o.plans or (4 if smoke else 50)
    other = None if o.against is None else load_other(o.against)
    for shape in o.shapes.split(","):
        rows, heads, width, slots = (int(x) for x in shape.split("x"))
        if width > slots:
            raise SystemExit(f"reuse_plan: {shape}: a plan wants at most as many pages as slots")
        yield ({"rows": rows, "kv_heads": heads, "width": width, "slots": slots},
               partial(plan_row, o, rows, heads, width, slots, other))


def load_other(path: str):
    spec = importlib.util.spec_from_file_location("other_reuse_plan", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.plan_reuse_triton


def plan_row(o, rows: int, heads: int, width: int, slots: int, other) -> dict:
    device = torch.device(o.device)
    gen = torch.Generator().manual_seed(rows * 1000 + width)
    row = {"us": plan_us(plan_reuse_, device, rows, heads, width, slots, o.plans, o.pages, gen)}
    if other is not None:
        row["other_us"] = plan_us(other, device, rows, heads, width, slots, o.plans, o.pages, gen)
        row["info"] = {"same_plans": same_plans(plan_reuse_, other, device, rows, heads, width,
                                                slots, gen)}
        row["info"]["ok"] = row["info"]["same_plans"]
    return row


def choices(gen, rows: int, heads: int, width: int, pages: int, device) -> torch.Tensor:
    """[rows, heads, width] distinct page ids a row and head, drawn from `pages`."""
    return torch.stack([torch.stack([torch.randperm(pages, generator=gen)[:width]
                                     for _ in range(heads)]) for _ in range(rows)]).to(device)


def slot_state(rows: int, heads: int, slots: int, device) -> tuple[torch.Tensor, ...]:
    return (torch.full((rows, heads, slots), -1, dtype=torch.int64, device=device),
            torch.zeros(rows, heads, dtype=torch.int64, device=device),
            torch.zeros(1, dtype=torch.int64, device=device))


def plan_us(plan, device, rows: int, heads: int, width: int, slots: int, plans: int, pages: int,
            gen) -> list[float]:
    wants = [choices(gen, rows, heads, width, pages, device) for _ in range(plans)]
    counts = torch.full((rows, heads), width, dtype=torch.int32, device=device)
    owners = torch.zeros(rows, dtype=torch.int64, device=device)
    held, owner, loaded = slot_state(rows, heads, slots, device)

    def all_plans():
        for want in wants:
            plan(held, owner, want, counts, owners, loaded)

    if device.type != "cuda":
        return [round(t / plans, 2) for t in wall_us(all_plans, REPLAYS)]
    all_plans()                                   # compiles, and fills the slots
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        all_plans()
    return [round(t * 1e3 / plans, 2) for t in cuda_times_ms(graph.replay, REPLAYS)]


def same_plans(plan, other, device, rows: int, heads: int, width: int, slots: int, gen) -> bool:
    """Six steps of choices from a range a little wider than the slots (so pages repeat),
    with counts short of the width: both give the same plans, slots and load counts."""
    states = [slot_state(rows, heads, slots, device) for _ in range(2)]
    owners = torch.zeros(rows, dtype=torch.int64, device=device)
    for _ in range(6):
        want = choices(gen, rows, heads, width, slots + width // 2 + 1, device)
        counts = torch.randint(0, width + 1, (rows, heads), generator=gen,
                               dtype=torch.int32).to(device)
        a = plan(*states[0][:2], want, counts, owners, states[0][2])
        b = other(*states[1][:2], want, counts, owners, states[1][2])
        if not (all(torch.equal(x, y) for x, y in zip(a, b))
                and all(torch.equal(x, y) for x, y in zip(states[0], states[1]))):
            return False
    return True
