"""Helpers of the benchmarks: the copy/compute overlap figure of benchmarks/offload.py on
synthetic traces, the quest benchmark's locality count and pipelined steps, and every
section of the quest benchmark and the GQA recall benchmark run through the harness
(benchmarks/run.py) with --smoke, the step timing of benchmarks/loop_hold.py, and the two
ways of page_gather.py agreeing."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from copy_overlap import copy_overlap  # noqa: E402

MiB = 1 << 20


def kernel(ts: float, dur: float) -> dict:
    return {"cat": "kernel", "name": "gemm", "ts": ts, "dur": dur, "args": {"stream": 7}}


def memcpy(ts: float, dur: float, kind: str = "HtoD", nbytes: int = 64 * MiB) -> dict:
    return {"cat": "gpu_memcpy", "name": f"Memcpy {kind} (Pinned -> Device)", "ts": ts, "dur": dur,
            "args": {"stream": 20, "bytes": nbytes}}


def test_copy_under_kernels_is_hidden_and_copy_alone_is_not():
    events = [kernel(0, 100), kernel(150, 100),          # busy 0-100 and 150-250
              memcpy(50, 100),                           # 50 of 100 us under kernels
              memcpy(300, 40, kind="DtoH")]              # nothing runs then
    result = copy_overlap(events)
    h2d = result["h2d"]
    assert (h2d["copies"], h2d["copy_ms"], h2d["hidden_ms"], h2d["hidden_fraction"]) == (1, 0.1, 0.05, 0.5)
    assert h2d["copy_GBps"] == pytest.approx(64 * MiB / 100e-6 / 1e9, rel=1e-3)
    assert h2d["concurrent_with_other_direction_ms"] == 0.0
    assert result["d2h"]["hidden_fraction"] == 0.0
    assert result["all"]["copy_ms"] == pytest.approx(0.14)
    assert result["all"]["hidden_fraction"] == pytest.approx(0.05 / 0.14, abs=1e-3)


def test_overlapping_kernels_are_not_counted_twice_and_small_copies_are_ignored():
    events = [kernel(0, 80), kernel(20, 80),             # two streams, union 0-100
              memcpy(0, 100), memcpy(0, 100, nbytes=4096)]
    result = copy_overlap(events)
    assert result["h2d"]["copies"] == 1
    assert result["h2d"]["hidden_fraction"] == 1.0
    assert copy_overlap([kernel(0, 10)])["all"]["hidden_fraction"] is None


def test_time_shared_by_both_directions_is_reported():
    result = copy_overlap([memcpy(0, 100), memcpy(60, 100, kind="DtoH")])
    assert result["h2d"]["concurrent_with_other_direction_ms"] == pytest.approx(0.04)
    assert result["d2h"]["concurrent_with_other_direction_ms"] == pytest.approx(0.04)


def test_quest_locality_counts_pages_picked_again_by_the_same_layer_and_head():
    from quest import carried_over
    step1 = {0: [{1, 2, 3, 4}, {5, 6}], 3: [{7, 8}]}
    step2 = {0: [{1, 2, 9, 10}, {6, 11}], 3: [{7, 8}]}     # 2 + 1 + 2 of 8 picks kept
    step3 = {0: [{5, 6, 1, 2}, {1, 2}], 3: [{9, 10}]}      # head 0 regains 1, 2; head 1 none
    assert carried_over([step1, step2, step3]) == [5 / 8, 2 / 8]


def test_pipelined_steps_time_each_step_and_lose_no_token(tmp_path):
    """The quest benchmark's pipelined timing launches step n+1 before reading step n back, as the
    engine's stages do: every step still delivers its token, in order, once."""
    from common import shaped_model, smollm2
    from quest import pipelined_steps

    from astream.base.config import EngineConfig
    from astream.base.sampling import SamplingParams
    from astream.core.engine_core import EngineCore

    config = EngineConfig(model=str(shaped_model("tiny", max_positions=512, root=tmp_path)),
                          load_format="dummy", tokenizer=smollm2(), device="cpu",
                          dtype="float32", max_num_seqs=2, max_model_len=512)
    core = EngineCore.create(config)
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    sink = core.add_request("a", list(range(100, 140)), params)
    while not sink.tokens:
        core.step()
    times = pipelined_steps(core, 6)
    assert len(times) == 5 and all(t > 0 for t in times)
    assert len(sink.tokens) == 1 + 7                     # the prefill's token, then 7 launches
    # The same tokens as synchronous steps from the same prompt.
    again = core.add_request("b", list(range(100, 140)), params)
    while len(again.tokens) < len(sink.tokens):
        core.step()
    assert again.tokens == sink.tokens
    core.close()


# Smaller than --smoke's own shapes where a section builds engines, to keep the test short.
SMOKE_SECTIONS = {
    "speed": ["--cases", "256x1", "--budgets", "full,64", "--steps", "2", "--prefetch", "0,1.5",
              "--late-fetch", "on,off", "--keys-on-device"],
    "kernels": [],
    "kernel_sweep": [],
    "layouts": [],
    "select_sweep": [],
    "locality": ["--ctx", "300"],
    "profile": [],
    "reuse": ["--ctx", "300", "--steps", "3"],
    # Contexts written straight into the host pool, the two-level selection on and off.
    "filled": ["--cases", "1024x2", "--groups", "off,on", "--steps", "2", "--keys-on-device"],
    # Its rows are checks (ok: the same tokens with and without prefetch), no figures.
    "prefetch": ["--cases", "300x2", "--steps", "4", "--prefetch", "1.5"],
    # float32: Quest at a covering budget (two-level selection) gives Full's tokens and
    # logprobs, reading every page; offloaded Full gives resident Full's.
    "agreement": ["--groups", "on"],
}


@pytest.mark.parametrize("section", sorted(SMOKE_SECTIONS))
def test_quest_sections_run_through_the_harness(section, tmp_path):
    import run
    out = tmp_path / "result.json"
    argv = ["quest", "--smoke", "--section", section, "--out", str(out), *SMOKE_SECTIONS[section]]
    assert run.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "quest" and result["device"] == "cpu"
    assert result["commit"] and result["options"]["section"] == section
    assert result["options"]["smoke"] is True and result["options"]["repeats"] == 1
    assert result["rows"]
    figures = 0
    for row in result["rows"]:
        assert set(row) == {"params", "figures", "info"} and row["params"]
        assert row["info"].get("ok", True) is True
        for name, figure in row["figures"].items():
            values = [v for repeat in figure["values"] for v in repeat]
            assert len(figure["values"]) == 1 and values, name
            assert figure["min"] <= figure["median"] <= figure["max"], name
            assert (figure["min"], figure["max"]) == (min(values), max(values)), name
            figures += 1
    assert figures


def test_quest_agreement_reports_where_runs_part_and_fails_beyond_the_limits():
    from quest import parting

    from astream.base.outputs import StreamToken

    def run(ids: list[int], margins: list[float], shift: float = 0.0) -> list[StreamToken]:
        return [StreamToken("r", i, t, "", logprob=-1.0 + shift,
                            top_logprobs=((t, -1.0), (7, -1.0 - m)))
                for i, (t, m) in enumerate(zip(ids, margins))]

    reference = run([5, 6, 8], [0.5, 0.1, 0.4])
    same = parting(reference, run([5, 6, 8], [0.5, 0.1, 0.4], shift=1e-6), (0.25, 1e-4))
    assert same["identical_tokens"] == 3 and same["info"]["parting"] is None and same["info"]["ok"]
    near_tie = parting(reference, run([5, 9, 3], [0.5, 0.02, 0.3]), (0.25, 1e-4))
    assert near_tie["identical_tokens"] == 1 and near_tie["info"]["ok"]
    assert near_tie["info"]["parting"] == {"step": 1, "margin": 0.1, "compared_margin": 0.02}
    assert not parting(reference, run([5, 9, 3], [0.5, 0.02, 0.3]), (-math.inf, 1e-4))["info"]["ok"]
    assert not parting(reference, run([5, 6, 9], [0.5, 0.1, 0.3]), (0.25, 1e-4))["info"]["ok"]
    drifted = parting(reference, run([5, 6, 8], [0.5, 0.1, 0.4], shift=0.01), (0.25, 1e-4))
    assert drifted["logprob_drift"] == 0.01 and not drifted["info"]["ok"]


def test_the_harness_pools_repeats_and_fails_a_row_marked_not_ok(tmp_path, monkeypatch):
    import run
    calls = iter([[3.0, 1.0], [2.0], [5.0, 4.0]])

    def cases(options):
        yield {"case": "a"}, lambda: {"ms": next(calls), "ok": options.repeats != 3, "note": "x"}

    monkeypatch.setitem(sys.modules, "fake_bench", type(sys)("fake_bench"))
    sys.modules["fake_bench"].cases = cases
    out = tmp_path / "r.json"
    assert run.main(["fake_bench", "--repeats", "3", "--device", "cpu", "--out", str(out)]) == 1
    row = json.loads(out.read_text())["rows"][0]
    assert row["figures"]["ms"] == {"min": 1.0, "median": 3.0, "max": 5.0,
                                    "values": [[3.0, 1.0], [2.0], [5.0, 4.0]]}
    assert row["info"] == {"ok": False, "note": "x"}


def test_a_filled_prefix_has_the_bounds_prefill_would_give_and_is_taken_as_cached(tmp_path):
    """kv_fill writes random KV into the host pool; the Quest page and group bounds are those
    of the stored keys, and a request for the prompt takes every filled block as cached."""
    import torch
    from common import engine_core, shaped_model, smollm2
    from kv_fill import fill_prefix

    from astream.base.config import EngineConfig
    from astream.base.sampling import SamplingParams
    from astream.ops import quest
    from astream.policies import QuestPolicy
    config = EngineConfig(model=str(shaped_model("tiny", 1024, root=tmp_path)), load_format="dummy",
                          tokenizer=smollm2(), device="cpu", dtype="float32", offload=True,
                          kv_cache_dtype="fp8_e4m3", kv_block_size=64, max_num_seqs=1,
                          max_model_len=1024, sparse_policy=QuestPolicy(budget_tokens=128,
                                                                        dense_layers=1, group_pages=4))
    with engine_core(config) as core:
        prompt = list(range(100, 100 + 960))
        assert fill_prefix(core, prompt) == 896
        runtime, engine = core.runner.policy, core.runner.offload
        ids = torch.arange(896 // 64)
        keys = engine.host_k[1][ids].transpose(1, 2)                # token-major blocks
        for bounds, page in ((runtime.bounds[1], 16), (runtime.groups[1], 64)):
            want = quest.bounds_of_blocks(keys, page)
            pages = ids.numel() * 64 // page
            assert all(torch.equal(b[:pages].float(), w.float()) for b, w in zip(bounds, want))
        sink = core.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        while len(sink.tokens) < 3:
            core.step()
        stats = core.stats()
        assert stats["prefix_cache_hits"] == 14 and sum(stats["quest_selections"]) > 0


def test_prefetch_recall_counts_pages_and_attention_mass_of_the_exact_selection():
    import torch
    from quest_prefetch import page_mask, ranked_union, recall

    # One KV head of two query heads, four pages; budget two pages. Exact {0, 1}, predicted {1, 2}.
    exact = page_mask(torch.tensor([[0, 1, 1]]), torch.tensor([2]), 4)
    predicted = page_mask(torch.tensor([[1, 2, 2]]), torch.tensor([2]), 4)
    assert exact.tolist() == [[True, True, False, False]]
    page_mass = torch.tensor([[0.4, 0.2, 0.1, 0.1], [0.1, 0.1, 0.5, 0.1]])
    tail = torch.tensor([0.2, 0.2])
    got = recall(predicted, exact, page_mass, tail, budget_pages=2)
    assert got["page_recall"].tolist() == [0.5]
    assert got["late"].tolist() == [0.5] and got["device"].tolist() == [1.0]
    assert got["mass_recall"].tolist() == pytest.approx([0.2 / 0.6, 0.1 / 0.2])
    assert got["mass_ratio"].tolist() == pytest.approx([0.5 / 0.8, 0.8 / 0.4])
    itself = recall(exact, exact, page_mass, tail, budget_pages=2)
    assert all(v.tolist() == pytest.approx([1.0] * len(v)) for k, v in itself.items() if k != "late")
    # The union keeps all of `first`, then `then`'s best-scored pages, up to the cap.
    first = torch.tensor([[True, False, False, False]])
    then = torch.tensor([[False, True, True, True]])
    scores = torch.tensor([[-5.0, 1.0, 3.0, 2.0]])
    assert ranked_union(first, then, scores, cap=3).tolist() == [[True, False, True, True]]
    assert ranked_union(first, then, scores, cap=1).tolist() == [[True, False, False, False]]


def test_quest_prefetch_runs_through_the_harness(tmp_path):
    import run
    out = tmp_path / "result.json"
    assert run.main(["quest_prefetch", "--smoke", "--out", str(out), "--context", "400",
                     "--budget", "64", "--steps", "2"]) == 0
    rows = {row["params"]["predictor"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"exact", "prev_step", "prev_layer", "early_query", "early_query_wide",
                         "prev_step+early_query"}
    for name, row in rows.items():
        figures = {key: figure["median"] for key, figure in row["figures"].items()}
        for key in ("page_recall", "mass_recall", "late"):
            assert 0.0 <= figures[f"{key}_p10"] <= 1.0 and 0.0 <= figures[f"{key}_mean"] <= 1.0, (name, key)
        assert figures["mass_ratio_mean"] > 0 and row["info"]["kv_head_samples"] > 0
    exact = {key: figure["median"] for key, figure in rows["exact"]["figures"].items()}
    assert exact["page_recall_mean"] == exact["page_recall_p10"] == 1.0
    assert exact["mass_recall_mean"] == exact["mass_ratio_mean"] == 1.0 and exact["late_mean"] == 0.0
    assert rows["exact"]["info"]["answers"][0]["task"] == "needle"


def test_quest_gqa_recall_runs_through_the_harness(tmp_path):
    """The GQA recall benchmark on the embedded model: its restated rules pick what the
    engine picks, and no rule of one selection per KV head beats the oracle's mean."""
    import run
    out = tmp_path / "result.json"
    rules = "max,sum,relative,share,rank,oracle"
    assert run.main(["quest_gqa", "--smoke", "--rules", rules, "--budgets", "0.25",
                     "--out", str(out)]) == 0
    rows = {row["params"]["rule"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == rules.split(",")
    for rule in ("max", "sum", "relative"):
        assert rows[rule]["figures"]["engine_jaccard"]["median"] == 1.0
        assert rows[rule]["info"]["ok"] is True
    mean = {rule: row["figures"]["recall_mean"]["median"] for rule, row in rows.items()}
    assert all(0 < m <= mean["oracle"] + 1e-6 for m in mean.values()) and mean["oracle"] <= 1 + 1e-6


def test_sparse_prefill_estimate_section_times_each_part_of_the_last_chunk():
    import torch
    from sparse_prefill import estimate_rows
    rows = estimate_rows([640], 256, 0.5, torch.device("cpu"), torch.float32, 1, ["32x32"])
    assert len(rows) == 1
    ms = rows[0]["ms"]
    assert set(ms) == {"score_one_walk", "score_split", "select", "kept_lists", "attend",
                       "score_split_32x32"}
    assert all(len(spread) == 3 and spread[0] > 0 for spread in ms.values())
    assert 0 < rows[0]["density"] < 1 and rows[0]["splits_vs_one_err"] == 0.0


def test_sparse_prefill_attention_section_takes_any_policy_by_its_spec():
    import torch
    from sparse_prefill import attention_rows
    rows = attention_rows([512], 256, [], torch.device("cpu"), torch.float32, 1, [],
                          ["flexprefill(gamma=0.3,min_budget=128)", "flexprefill(gamma=1.0)"])
    by_method = {row["method"]: row for row in rows}
    assert list(by_method) == ["dense", "flexprefill(gamma=0.3,min_budget=128)", "flexprefill(gamma=1.0)"]
    sparse, exact = by_method["flexprefill(gamma=0.3,min_budget=128)"], by_method["flexprefill(gamma=1.0)"]
    assert 0 < sparse["density"] < 1 and exact["density"] == 1.0
    assert set(sparse["last_chunk_ms"]) == {"estimate", "select", "attend"}
    assert all(ms > 0 for ms in sparse["last_chunk_ms"].values())
    assert 0 < sparse["last_chunk_density"] < exact["last_chunk_density"] == 1.0


def test_loop_hold_times_every_chunk_of_a_long_prompt_and_its_token_arrives():
    from common import engine_core
    from loop_hold import engine_config, timed_step
    from astream.base.sampling import SamplingParams
    with engine_core(engine_config(300, 128, smoke=True)) as core:
        sink = core.add_request("r", list(range(100, 400)), SamplingParams(max_tokens=1, ignore_eos=True))
        rows = []
        while (row := timed_step(core)) is not None:
            rows.append(row)
    assert [row["prefill_tokens"] for row in rows] == [128, 128, 44]     # the budget's chunks
    assert len(sink.tokens) == 1
    for row in rows:
        assert 0 < row["layer_ms_max"] <= row["hold_ms"] <= row["launch_ms"] + row["prepare_ms"]
        assert row["stretches"] >= 2                 # the tiny model's layers, then the sampler


@pytest.mark.parametrize("page_size", [16, 8])
def test_page_gather_reads_the_same_attention_both_ways(page_size, tmp_path):
    """Gathered then attended, or attended in place from the host pool: the same output and
    log-sum-exp, with pages of a whole block and of half one."""
    import run
    out = tmp_path / "page_gather.json"
    assert run.main(["page_gather", "--smoke", "--kv-heads", "2,1", "--page-size", str(page_size),
                     "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["params"]["kv_heads"] for row in rows] == [2, 1]
    for row in rows:
        assert row["info"]["ok"] and row["info"]["out_diff"] == 0 and row["info"]["lse_diff"] == 0
        assert row["figures"]["gathered_us"]["median"] > 0
        assert row["figures"]["in_place_us"]["median"] > 0


@pytest.mark.parametrize("wrong", [False, True])
def test_reuse_plan_checks_another_plan_against_this_trees(wrong, tmp_path):
    """--against times another plan beside the tree's and fails the row where its plans
    differ; on the CPU both are the torch reference, one of them spoiled on demand."""
    import run
    other = tmp_path / "other_plan.py"
    other.write_text(
        "from astream.policies.quest.page_reuse import plan_reuse_\n"
        "def plan_reuse_triton(*args):\n"
        "    page_list, load_to = plan_reuse_(*args)\n"
        f"    return (page_list.flip(-1) if {wrong} else page_list), load_to\n")
    out = tmp_path / "reuse_plan.json"
    code = run.main(["reuse_plan", "--smoke", "--shapes", "1x2x16x24,2x1x8x8", "--against",
                     str(other), "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert code == (1 if wrong else 0)
    assert [row["params"]["width"] for row in rows] == [16, 8]
    for row in rows:
        assert row["info"]["same_plans"] is (not wrong)
        assert row["figures"]["us"]["median"] > 0 and row["figures"]["other_us"]["median"] > 0
