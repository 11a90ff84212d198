"""The window policy (attention sink + recent pages at decode): its selection against a
statement of the rule, and through the engine: exact when the budget covers the context,
the same tokens resident and offloaded, and blind to the middle of a long prompt."""

from __future__ import annotations

import random

import pytest
import torch

from astream import LLM, SamplingParams
from astream.eval.haystack import build_prompt
from astream.eval.tasks import needle
from astream.policies import DecodeQuery, KVLayout, WindowPolicy, make_policy

KW = dict(device="cpu", dtype="float32", kv_block_size=16, num_kv_blocks=384, max_model_len=2048)
GREEDY = SamplingParams(temperature=0, max_tokens=16)


def _layout(block_size: int) -> KVLayout:
    return KVLayout(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, num_blocks=64,
                    block_size=block_size, dtype=torch.float32, device=torch.device("cpu"),
                    offload=False, key_dtype=torch.float32, max_num_seqs=1)


def _expected(num_pages: int, budget: int, sink: int) -> list[int]:
    if num_pages <= budget:
        return list(range(num_pages))
    return list(range(sink)) + list(range(num_pages - (budget - sink), num_pages))


@pytest.mark.parametrize("append_newest", [False, True])
def test_selection_is_the_sink_then_the_newest_pages(append_newest):
    policy = WindowPolicy(budget_tokens=64, page_size=8, sink_pages=2)       # 8 pages, 2 sink
    block = 16
    runtime = policy.bind(_layout(block))
    gen = torch.Generator().manual_seed(0)
    lens = [1, 8, 9, 64, 65, 200, 333] if not append_newest else [16, 64, 80, 192, 320]
    tables = torch.randint(0, 64, (len(lens), 24), generator=gen, dtype=torch.int32)
    context = torch.tensor(lens, dtype=torch.int32)
    query = DecodeQuery(torch.zeros(len(lens), 4, 8), tables, context, max(lens),
                        append_newest=append_newest, physical=True)
    chosen = runtime.select_decode(0, query)
    for row, length in enumerate(lens):
        want = _expected(-(-length // 8), 8, 2)
        if append_newest:                              # the block after the full ones, whole
            want += [length // 8 + j for j in range(block // 8)]
        for head in range(2):
            count = int(chosen.counts[row, head])
            got = chosen.indices[row, head, :count].tolist()
            assert got == want, (length, got, want)
            pages = chosen.indices[row, head].long()
            assert chosen.physical[row, head].tolist() == \
                (tables[row, pages // 2].long() * 2 + pages % 2).tolist()


def test_window_is_a_policy_name_with_a_budget():
    policy = make_policy("window(sink_pages=2)", 512)
    assert policy == WindowPolicy(budget_tokens=512, sink_pages=2)
    with pytest.raises(ValueError, match="must hold the sink"):
        WindowPolicy(budget_tokens=16, page_size=16, sink_pages=1)


@pytest.fixture(scope="module")
def passkey(smollm2_tokenizer):
    problem = needle(random.Random(3), 1200, 0.5)
    return list(build_prompt(smollm2_tokenizer, problem, 1200, random.Random(3)).ids), problem.expected[0]


def test_through_the_engine(passkey):
    """Full finds a key in the middle of the prompt; a 256-token window cannot see it, and
    reads the same pages resident and offloaded; a covering window is Full."""
    prompt, key = passkey
    outputs = {}
    for name, options in {"full": {}, "window": dict(sparse_policy="window", sparse_budget=256),
                          "window offload": dict(sparse_policy="window", sparse_budget=256, offload=True),
                          "covering": dict(sparse_policy="window", sparse_budget=2048)}.items():
        with LLM(**KW, **options) as llm:
            outputs[name] = llm.generate([prompt], GREEDY)[0]
            stats = llm.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert key in outputs["full"].text
    assert key not in outputs["window"].text
    assert outputs["window"].token_ids == outputs["window offload"].token_ids
    assert outputs["covering"].token_ids == outputs["full"].token_ids
