"""GGUF files built on the fly: layouts of each architecture, and clear errors for bad files."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from astream.models.gguf_loader import SUPPORTED_GGUF_TENSOR_TYPES, read_gguf
from astream.models.gguf_tokenizer import load_gguf_tokenizer

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
    values = rng.standard_normal((64, hidden)).astype(np.float32) * 3.0
    q8 = np.ascontiguousarray(gguf.quants.quantize(values, QT.Q8_0)).view(np.uint8)
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



def test_missing_required_metadata(tmp_path):
    kv = tiny_kv("llama")
    del kv["llama.block_count"]
    path = write_gguf(tmp_path / "nometa.gguf", "llama", tiny_weights(np.random.default_rng(8)), kv)
    with pytest.raises(ValueError, match=r"lacks llama\.block_count"):
        read_gguf(path)
