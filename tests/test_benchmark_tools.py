"""The copy/compute overlap figure reported by benchmarks/offload.py, on synthetic traces."""

from __future__ import annotations

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
    from quest_locality import carried_over
    step1 = {0: [{1, 2, 3, 4}, {5, 6}], 3: [{7, 8}]}
    step2 = {0: [{1, 2, 9, 10}, {6, 11}], 3: [{7, 8}]}     # 2 + 1 + 2 of 8 picks kept
    step3 = {0: [{5, 6, 1, 2}, {1, 2}], 3: [{9, 10}]}      # head 0 regains 1, 2; head 1 none
    assert carried_over([step1, step2, step3]) == [5 / 8, 2 / 8]


def test_pipelined_steps_time_each_step_and_lose_no_token(tmp_path):
    """quest.py's pipelined timing launches step n+1 before reading step n back, as the
    engine's stages do: every step still delivers its token, in order, once."""
    from common import shaped_model, smollm2
    from quest import pipelined_steps

    from astream.config import EngineConfig
    from astream.core import EngineCore
    from astream.sampling import SamplingParams

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
