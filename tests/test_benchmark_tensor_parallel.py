"""The tensor-parallel benchmark through the harness (benchmarks/run.py) with --smoke: every
section at one and two ranks over gloo, each rank's link counted once, and the ratio table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_every_section_runs_at_one_and_two_ranks(tmp_path, capsys):
    import run
    out = tmp_path / "result.json"
    argv = ["tensor_parallel", "--smoke", "--out", str(out), "--steps", "2", "--offload-steps", "1",
            "--num", "3", "--decode", "64x2", "--offload", "96x2,96x1", "--quest", "160x1"]
    assert run.main(argv) == 0
    result = json.loads(out.read_text())
    rows = {(r["params"]["section"], r["params"]["tp"], r["params"].get("batch")): r
            for r in result["rows"]}
    assert sorted(rows) == sorted([("decode", 1, 2), ("decode", 2, 2), ("throughput", 1, None),
                                   ("throughput", 2, None), ("offload", 1, 2), ("offload", 1, 1),
                                   ("offload", 2, 2), ("offload", 2, 1), ("quest", 1, 1),
                                   ("quest", 2, 1)])
    # a section's rows at both sizes before the next section's
    assert [(r["params"]["section"], r["params"]["tp"]) for r in result["rows"]] == \
        [("decode", 1), ("decode", 2), ("throughput", 1), ("throughput", 2), ("offload", 1),
         ("offload", 1), ("offload", 2), ("offload", 2), ("quest", 1), ("quest", 2)]
    for row in result["rows"]:
        assert row["info"].get("ok", True) is True
    for key in (("decode", 1, 2), ("decode", 2, 2), ("quest", 2, 1)):
        figures = rows[key]["figures"]
        assert len(figures["step_ms"]["values"][0]) == 2
        assert len(figures["pipelined_step_ms"]["values"][0]) == 2
    assert rows[("throughput", 2, None)]["info"]["output_tokens"] == \
        rows[("throughput", 1, None)]["info"]["output_tokens"] > 0

    def per_step(key, figure):
        return rows[key]["figures"][figure]["median"]
    # Rank 0 loads its own half of the KV heads: half of one rank's bytes, over its own link.
    for batch in (2, 1):
        whole = per_step(("offload", 1, batch), "bytes_loaded_per_step")
        assert whole > 0 and per_step(("offload", 2, batch), "bytes_loaded_per_step") * 2 == whole
    assert per_step(("offload", 1, 2), "bytes_loaded_per_step") == \
        2 * per_step(("offload", 1, 1), "bytes_loaded_per_step")
    gathered = per_step(("quest", 1, 1), "bytes_gathered_per_step")
    assert gathered > 0 and per_step(("quest", 2, 1), "bytes_gathered_per_step") * 2 == gathered
    assert per_step(("quest", 1, 1), "pages_loaded_per_step") == 0     # no page buffers
    assert rows[("offload", 2, 1)]["figures"]["link_gb_s"]["median"] > 0

    table = capsys.readouterr().out.split("ratio = TP=2 / TP=1")[1]
    lines = {tuple(line.split()[:3]): line for line in table.splitlines() if line.strip()}
    for section, case, figure, goal in (("offload", "96x2", "step_ms", "<= 0.55"),
                                        ("quest", "160x1", "step_ms", "<= 0.6"),
                                        ("throughput", "n=3", "output_tok_s", ">= 1.7")):
        line = lines[(section, case, figure)]
        assert goal in line and ("met" in line or "MISSED" in line)
        tp1, tp2 = (rows[(section, tp, None if section == "throughput" else int(case[-1]))]
                    ["figures"][figure]["median"] for tp in (1, 2))
        assert f"{tp2 / tp1:.3f}" in line


def test_the_check_compares_graphs_with_eager_and_one_rank(tmp_path, capsys):
    """On the CPU the graphs' static programs run on both ranks: the same tokens as TP=2
    eager and TP=1, and every row passes; the speed table leaves the check rows out."""
    import run
    out = tmp_path / "result.json"
    assert run.main(["tensor_parallel", "--smoke", "--sections", "check", "--check-prompts", "2",
                     "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["params"]["shape"], r["params"]["mode"]) for r in rows] == \
        [("tiny", "resident"), ("tiny", "quest_offload")]
    for row in rows:
        assert row["info"]["ok"] is True and row["info"]["temperature_ok"] is True
        assert row["figures"]["graph_steps_tp2"]["median"] > 0
        assert row["info"]["tp2_graphs_vs_tp2_eager"]["identical"] == 2
    assert "ratio = TP=2" not in capsys.readouterr().out


def test_the_profile_section_splits_rank_0s_step_time_by_kernel_kind(tmp_path):
    import run
    from tensor_parallel import kernel_kind
    out = tmp_path / "profile.json"
    assert run.main(["tensor_parallel", "--smoke", "--sections", "profile", "--num", "3",
                     "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["params"]["section"], r["params"]["tp"]) for r in rows] == [("profile", 1), ("profile", 2)]
    for row in rows:
        figures = {name: f["median"] for name, f in row["figures"].items()}
        assert figures["step_ms"] > 0
        kinds = sum(figures[f"{k}_ms"] for k in ("attention", "gemm", "all_reduce", "logits_gather", "other"))
        assert abs(figures["busy_ms"] - kinds) < 1e-3
    assert [kernel_kind(name) for name in (
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "_decode_split_kernel", "_selected_split_kernel", "nvjet_sm90_tst_192x112_64x5_1x2_h_bz_TNT",
        "_add_rms_norm_kernel")] == ["all_reduce", "logits_gather", "attention", "attention", "gemm",
                                     "other"]


def test_the_quest_section_takes_the_policys_other_fields(tmp_path):
    """--quest-options reach each rank's QuestPolicy: the one sparse layer reads the pages
    its prediction loaded, each rank its own half of the KV heads'."""
    import run
    out = tmp_path / "result.json"
    argv = ["tensor_parallel", "--smoke", "--out", str(out), "--sections", "quest", "--steps", "2",
            "--quest", "160x1", "--dense-layers", "1", "--quest-options", "prefetch=1,late_fetch=False"]
    assert run.main(argv) == 0
    rows = {r["params"]["tp"]: r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == [1, 2]
    for row in rows.values():
        assert (row["params"]["prefetch"], row["params"]["late_fetch"]) == (1, False)
        assert row["figures"]["pages_loaded_per_step"]["median"] > 0    # by the prefetch
    gathered = [rows[tp]["figures"]["bytes_gathered_per_step"]["median"] for tp in (1, 2)]
    assert gathered[0] > 0 and gathered[1] * 2 == gathered[0]
