"""Policy names with parameters ("minference(vertical_size=4000)"): what engines, `astream
serve` and `astream eval --compare` accept, and the errors that name what is wrong."""

from __future__ import annotations

import pytest

from astream import LLM, SamplingParams
from astream.eval import parse_configs
from astream.face.cli import _configs, build_parser
from astream.policies import CombinedPolicy, MInferencePolicy, QuestPolicy, XAttentionPolicy, make_policy

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG = " ".join(f"Item {i} costs {i * 13 % 50} dollars." for i in range(40)) + " Which item costs most?"


def test_parameters_in_a_name_build_that_policy():
    assert make_policy("minference(vertical_size=4000, slash_size=24384)") == MInferencePolicy(
        vertical_size=4000, slash_size=24384)
    assert make_policy("xattention( threshold = 0.95 )") == XAttentionPolicy(threshold=0.95)
    assert make_policy("quest(gqa_reduce=sum, page_size=32)", 1024) == QuestPolicy(
        budget_tokens=1024, gqa_reduce="sum", page_size=32)
    assert make_policy("minference(scale_with_length=false)").scale_with_length is False
    combined = make_policy("xattention(threshold=0.95)+quest(dense_layers=1)", 512)
    assert combined == CombinedPolicy(prefill=XAttentionPolicy(threshold=0.95),
                                      decode=QuestPolicy(budget_tokens=512, dense_layers=1))


@pytest.mark.parametrize("spec, budget, message", [
    ("minference(vertical=3)", None, "minference has no parameter 'vertical'"),
    ("xattention(threshold=high)", None, "threshold must be"),
    ("xattention(threshold=1/2)", None, "threshold='1/2' is not a number"),
    ("xattention(threshold)", None, "'threshold' is not key=value"),
    ("xattention(threshold=0.5, threshold=0.6)", None, "'threshold' is given twice"),
    ("quest(budget_tokens=512)", 1024, "give the budget once"),
    ("quest(", None, "unbalanced parentheses"),
    ("quest(page_size=32))x", None, "unbalanced parentheses"),
    ("quest x", None, "cannot read 'quest x'"),
    ("nosuch(x=1)+quest", None, "unknown sparse_policy 'nosuch'"),
    ("xattention(threshold=2.0)", None, "threshold must be in"),
    ("quest)+xattention", None, "unbalanced parentheses"),
])
def test_bad_parameters_are_named(spec, budget, message):
    with pytest.raises(ValueError, match=message):
        make_policy(spec, budget)


def test_an_engine_runs_the_policy_its_name_describes(smol_llm):
    want = smol_llm.generate([LONG], GREEDY)[0].token_ids
    # Threshold 1 keeps every block: Full's tokens through the whole sparse prefill path.
    spec = "xattention(threshold=1.0, block_size=16, stride=4)"
    with LLM(device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=2048,
             sparse_policy=spec) as llm:
        assert llm.generate([LONG], GREEDY)[0].token_ids == want
        stats = llm.stats()
    assert stats["sparse_policy"] == spec and all(d == 1.0 for d in stats["xattention_density"])


def test_serve_and_eval_take_parameters():
    spec = "minference(vertical_size=4000,slash_size=24384)"
    engine_kw, _ = _configs(build_parser().parse_args(["serve", "--sparse-policy", spec]))
    assert make_policy(engine_kw["sparse_policy"]) == MInferencePolicy(vertical_size=4000, slash_size=24384)
    configs = parse_configs(f"full,xattention(threshold=0.95),{spec}+quest:2048")
    assert [c.name for c in configs] == ["full", "xattention(threshold=0.95)", f"{spec}+quest:2048"]
    assert configs[2].engine_kwargs == {"sparse_policy": f"{spec}+quest", "sparse_budget": 2048,
                                        "offload": False}
    with pytest.raises(ValueError, match="--compare item 'xattention\\(tau=0.9\\)'.*no parameter 'tau'"):
        parse_configs("full,xattention(tau=0.9)")
    with pytest.raises(ValueError, match="bad --compare 'quest\\),full': unbalanced"):
        parse_configs("quest),full")
