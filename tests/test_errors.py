"""Bad input gets a clear error, and the engine keeps working afterwards."""

from __future__ import annotations

import json
import shutil

import pytest

from astream import LLM, SamplingParams


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_k": -1}, "top_k"),
    ({"stop": [""]}, "stop"),
])
def test_invalid_sampling_params_raise_when_constructed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_unknown_sampling_param_is_named():
    with pytest.raises(ValueError, match="temprature"):
        SamplingParams.from_dict({"temprature": 1.0})


def test_prompt_longer_than_max_model_len_names_both_numbers(smol_llm):
    prompt = list(range(100, 2200))
    with pytest.raises(ValueError, match=r"2100.*2048"):
        smol_llm.generate([prompt], SamplingParams(max_tokens=4))


@pytest.mark.parametrize("prompt", ["", [], [{"role": "user"}], [1, "a"], [10**9]])
def test_bad_prompts_raise_value_error(smol_llm, prompt):
    with pytest.raises(ValueError):
        smol_llm.generate([prompt], SamplingParams(max_tokens=4))


def test_engine_still_works_after_bad_input(smol_llm):
    with pytest.raises(ValueError):
        smol_llm.generate(["fine", ""], SamplingParams(max_tokens=2))
    out = smol_llm.generate(["fine"], SamplingParams(temperature=0, max_tokens=2))[0]
    assert len(out.token_ids) == 2
    assert smol_llm.stats()["running"] == 0 and smol_llm.stats()["waiting"] == 0


def test_missing_model_path_is_named(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        LLM(str(missing), device="cpu")


def test_unknown_engine_option_is_named():
    with pytest.raises(TypeError, match="num_kv_blockz"):
        LLM(device="cpu", num_kv_blockz=3)


def test_truncated_safetensors_is_a_clear_error(tiny_qwen3, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_qwen3, broken)
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        LLM(str(broken), device="cpu", num_kv_blocks=16)


def test_truncated_gguf_is_a_clear_error(smollm2_path, tmp_path):
    cut = tmp_path / "cut.gguf"
    with smollm2_path.open("rb") as src:
        cut.write_bytes(src.read(30_000_000))
    with pytest.raises(ValueError, match="truncated or corrupt"):
        LLM(str(cut), device="cpu", num_kv_blocks=16)


def test_unsupported_architecture_lists_supported(tiny_qwen3, tmp_path):
    other = tmp_path / "gpt2ish"
    shutil.copytree(tiny_qwen3, other)
    config = json.loads((other / "config.json").read_text())
    config["model_type"] = "gpt2"
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"gpt2.*llama, qwen2, qwen3"):
        LLM(str(other), device="cpu", num_kv_blocks=16)


def test_max_model_len_beyond_cache_says_what_fits():
    with pytest.raises(ValueError, match=r"does not fit.*4 blocks x 16 tokens = 64"):
        LLM(device="cpu", num_kv_blocks=4, max_model_len=1024)


@pytest.mark.parametrize("kwargs", [{"temperature": True}, {"top_p": True}, {"stop_token_ids": ["5"]},
                                    {"stop_token_ids": [5.7]}, {"stop_token_ids": [-1]}])
def test_sampling_params_reject_wrong_types(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_prompt_too_long_has_its_own_type(smol_llm):
    from astream.core.scheduler import PromptTooLongError
    with pytest.raises(PromptTooLongError):
        smol_llm.generate([list(range(100, 2200))], SamplingParams(max_tokens=4))


def test_old_offload_prefetch_layers_keyword_warns_and_still_works():
    from astream import EngineConfig
    with pytest.warns(DeprecationWarning, match="offload_ring_slots"):
        config = EngineConfig(offload=True, offload_prefetch_layers=2)
    assert config.offload_ring_slots == 3
    with pytest.raises(ValueError, match="offload_ring_slots"):
        EngineConfig(offload_ring_slots=0)
