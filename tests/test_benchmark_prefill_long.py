"""The long-prefill benchmark through the harness (benchmarks/run.py) with --smoke: one prompt
per context prefilled offloaded in fp8, with Full prefill and with a sparse prefill policy (its
density reported), then the quadratic fit of their times read back from the result files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.parametrize("policy,sparse", [("quest(dense_layers=1)", False),
                                           ("xattention(threshold=0.9)+quest(dense_layers=1)", True)])
def test_one_prompt_a_context_then_the_fit(policy, sparse, tmp_path, capsys):
    import run
    out = tmp_path / "one.json"
    assert run.main(["prefill_long", "--smoke", "--out", str(out), "--ctx", "640,1280",
                     "--policy", policy]) == 0
    result = json.loads(out.read_text())
    assert [row["params"]["ctx"] for row in result["rows"]] == [640, 1280]
    for row in result["rows"]:
        figures, info = row["figures"], row["info"]
        assert info["complete"] is True and info["prefilled"] == info["prompt_tokens"] == row["params"]["ctx"] - 1
        # 256-token steps: a chunk a step, each timed
        assert len(figures["chunk_s"]["values"][0]) == info["chunks"] == -(-info["prompt_tokens"] // 256)
        assert figures["seconds"]["median"] > 0 and figures["tok_s"]["median"] > 0
        assert "prefill_context" in info["plan"] and info["ring_slots"] == 3
        assert ("density" in figures) == sparse
        if sparse:
            assert 0 < figures["density"]["median"] <= 1
    # Chunks after the first read their prefix from the host pool: bytes crossed.
    assert result["rows"][1]["figures"]["h2d_gb"]["median"] > 0
    fit = tmp_path / "fit.json"
    assert run.main(["prefill_long", "--smoke", "--section", "fit", "--inputs", str(out),
                     "--target", "4096", "--out", str(fit)]) == 0
    row = json.loads(fit.read_text())["rows"][0]
    a, b, c = (row["figures"][k]["median"] for k in "abc")
    assert a == 0 and row["info"]["points"][0][0] == 640           # two contexts: t = bL + cL^2
    for length, seconds in row["info"]["points"]:
        assert b * length + c * length ** 2 == pytest.approx(seconds, rel=1e-6, abs=1e-9)
    assert row["figures"]["seconds_at_target"]["median"] == pytest.approx(b * 4096 + c * 4096 ** 2)
    assert "t(4096) = " in capsys.readouterr().out


def test_the_fit_of_three_points_is_least_squares():
    from prefill_long import quadratic_fit
    a, b, c = quadratic_fit([1, 2, 4], [3 + 2 + 0.5, 3 + 4 + 2, 3 + 8 + 8])
    assert (a, b, c) == pytest.approx((3, 2, 0.5))
