"""A policy's traits, declared once at bind, are what the engine lays every step out by:
through the engine, resident and offloaded, its hooks run on exactly the layers it
declares, its step plan once a step, and its stats reach `stats()` under its own names."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from astream import LLM, SamplingParams
from astream.policies import (
    CombinedPolicy, KVLayout, PolicyTraits, QuestPolicy, StepShape, WindowPolicy, XAttentionPolicy,
)
from astream.policies.window import WindowRuntime

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = ["The quick brown fox jumps over the lazy dog and keeps on running " * 6,
           "def fibonacci(n):"]
MODES = [pytest.param(False, id="resident"), pytest.param(True, id="offload")]


@dataclass(slots=True)
class RecordingRuntime(WindowRuntime):
    """A window whose budget covers every context (Full's tokens) and which notes where its
    hooks are called."""

    calls: dict[str, set[int]] = field(default_factory=lambda: {
        "on_kv_written": set(), "select_decode": set(), "prefill_attention": set()})
    plans: list[StepShape] = field(default_factory=list)

    def plan_step(self, shape):
        self.plans.append(shape)
        return WindowRuntime.plan_step(self, shape)

    def on_kv_written(self, layer, keys, slots):
        self.calls["on_kv_written"].add(layer)

    def select_decode(self, layer, query):
        self.calls["select_decode"].add(layer)
        return WindowRuntime.select_decode(self, layer, query)

    def prefill_attention(self, layer, q, k, v, meta, causal, scale):
        self.calls["prefill_attention"].add(layer)
        return None

    def stats(self):
        return {"recorded_layers": {hook: sorted(layers) for hook, layers in self.calls.items()},
                "recorded_plans": len(self.plans)}


@dataclass(slots=True, frozen=True)
class RecordingPolicy(WindowPolicy):
    decode: frozenset[int] = frozenset()
    prefill: frozenset[int] = frozenset()
    watches: bool = False
    above: int = 0
    on_device: tuple[int, ...] = ()
    name = "recording"

    def offload_device_layers(self, num_layers):
        return self.on_device

    def bind(self, layout):
        traits = PolicyTraits(watches_keys=self.watches, decode_layers=self.decode,
                              select_above=self.above, prefill_layers=self.prefill,
                              device_layers=frozenset(self.on_device if layout.offload else ()))
        return RecordingRuntime(self, layout, traits=traits)


def run(model, policy, offload: bool, **engine):
    with LLM(str(model), device="cpu", dtype="float32", kv_block_size=16, num_kv_blocks=256,
             max_model_len=512, offload=offload, sparse_policy=policy, **engine) as llm:
        tokens = [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
        return tokens, llm.stats()


@pytest.fixture(scope="module")
def full_tokens(tiny_qwen3):
    return run(tiny_qwen3, "full", False)[0]


@pytest.mark.parametrize("offload", MODES)
def test_hooks_run_on_exactly_the_declared_layers(tiny_qwen3, full_tokens, offload):
    policy = RecordingPolicy(budget_tokens=512, decode=frozenset({1, 2}), prefill=frozenset({0}),
                             watches=True, on_device=(0,))
    tokens, stats = run(tiny_qwen3, policy, offload)
    assert tokens == full_tokens                   # a covering window and no replaced prefill
    assert stats["recorded_layers"] == {"on_kv_written": [0, 1, 2], "select_decode": [1, 2],
                                        "prefill_attention": [0]}
    assert stats["recorded_plans"] == stats["steps"]          # once a step, not once a layer
    if offload:
        assert stats["offload_device_layers"] == [0]


@pytest.mark.parametrize("offload", MODES)
def test_a_policy_that_declares_nothing_is_never_called(tiny_qwen3, full_tokens, offload):
    tokens, stats = run(tiny_qwen3, RecordingPolicy(budget_tokens=512), offload)
    assert tokens == full_tokens
    assert stats["recorded_layers"] == {"on_kv_written": [], "select_decode": [],
                                        "prefill_attention": []}


def test_decode_selects_only_past_the_declared_context(tiny_qwen3, full_tokens):
    """`select_above`: steps whose longest decode context is within it select nothing."""
    policy = RecordingPolicy(budget_tokens=512, decode=frozenset({0, 1, 2}), above=400)
    tokens, stats = run(tiny_qwen3, policy, False)
    assert tokens == full_tokens
    assert stats["recorded_layers"]["select_decode"] == []


def test_quest_reports_its_stats_through_its_runtime(tiny_qwen3):
    """The engine names no policy: Quest's counters come with Quest, and none without it."""
    _, stats = run(tiny_qwen3, QuestPolicy(budget_tokens=32, dense_layers=1), True)
    assert stats["quest_pages_loaded"] == [0, 0, 0]
    assert stats["quest_selections"][0] == 0 and all(n > 0 for n in stats["quest_selections"][1:])
    _, stats = run(tiny_qwen3, "full", True)
    assert not any(key.startswith("quest") for key in stats)


def test_device_layers_the_memory_plan_did_not_count_are_an_error(tiny_qwen3):
    @dataclass(slots=True, frozen=True)
    class Unplanned(RecordingPolicy):
        def offload_device_layers(self, num_layers):
            return ()

    with pytest.raises(ValueError, match=r"keeps layers \[0\] on the device.*counted \[\]"):
        run(tiny_qwen3, Unplanned(budget_tokens=512, on_device=(0,)), True)


def _layout(offload: bool) -> KVLayout:
    return KVLayout(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8, num_blocks=16,
                    block_size=16, dtype=torch.float32, device=torch.device("cpu"),
                    offload=offload, key_dtype=torch.float32, max_num_seqs=2)


@pytest.mark.parametrize("offload", [False, True])
def test_builtin_policies_declare_their_layers(offload):
    quest = QuestPolicy(budget_tokens=64, dense_layers=1, reuse_pages=offload).bind(_layout(offload))
    assert quest.traits == PolicyTraits(
        watches_keys=True, decode_layers=frozenset({1, 2, 3}), select_above=64, loads_pages=offload,
        device_layers=frozenset({0} if offload else ()))
    combined = CombinedPolicy(XAttentionPolicy(), QuestPolicy(budget_tokens=64, dense_layers=1)
                              ).bind(_layout(offload))
    assert combined.traits.prefill_layers == frozenset(range(4))
    assert combined.traits.decode_layers == frozenset({1, 2, 3}) and combined.traits.watches_keys
    window = WindowPolicy(budget_tokens=64).bind(_layout(offload))
    assert window.traits == PolicyTraits(decode_layers=frozenset(range(4)), select_above=64)
    # The step plan: selection once a decode row's context passes the budget, and none
    # without decode rows.
    assert quest.plan_step(StepShape(2, 64)).select_layers == frozenset()
    assert quest.plan_step(StepShape(0, 65)).select_layers == frozenset()
    chosen = quest.plan_step(StepShape(2, 65))
    assert chosen.select_layers == frozenset({1, 2, 3}) and chosen.load_pages == offload


def test_quest_stays_inside_policies_and_its_kernels():
    """No layer but policies/quest/ and ops/ imports Quest; the window policy, the example a
    policy author follows, imports nothing outside policies/ and ops/."""
    from test_layers import all_modules

    def quest(name: str) -> bool:
        return any(part.lower().split("_")[0] in ("quest", "questpolicy", "questruntime")
                   or part.startswith("triton_quest") for part in name.split("."))

    modules = all_modules()
    leaks = {name: sorted(filter(quest, imports)) for name, imports in modules.items()
             if not name.startswith(("astream.policies", "astream.ops"))}
    assert not {name: found for name, found in leaks.items() if found}
    assert not list(filter(quest, modules["astream.ops.backends"]))
    window = {i for i in modules["astream.policies.window"] if i.startswith("astream.")}
    assert all(i.startswith(("astream.policies.", "astream.ops.")) for i in window), window
