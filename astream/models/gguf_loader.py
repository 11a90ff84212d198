"""Loading llama / qwen2 / qwen3 checkpoints from GGUF files.

The header is read once by `gguf_layout.read_header` (metadata and tensor positions)
and kept in the checkpoint, so the tokenizer (`gguf_tokenizer`) is built from it without
reading the file again. The tensor data is memory-mapped, and tensors are dequantized one
at a time with torch (`astream.models.dequant`), on the device the caller asks for, and
renamed and reshaped to the Hugging Face layout. A tensor-parallel rank reads and
dequantizes only the blocks that hold its slice (`astream.models.gguf_slice`).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, LlamaFileType

from astream.models.dequant import SUPPORTED_QUANT_TYPES, dequantize
from astream.models.gguf_slice import block_slice
from astream.models.tensor_parallel import Slice, TPShard, pad_rows
from astream.models.gguf_layout import (
    SUPPORTED_GGUF_TENSOR_TYPES,  # noqa: F401  (part of this module's API)
    ArrayValue,
    GGUFHeader,
    check_gguf_path,
    corrupt_file_error,
    read_header,
    unsupported_type_error,
)

logger = logging.getLogger(__name__)

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")

_HF_ARCHITECTURES = MappingProxyType(
    {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
)
_GLOBAL_TENSORS = MappingProxyType(
    {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
)
_LAYER_TENSORS = MappingProxyType(
    {
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
)
# Llama 3 files carry their RoPE frequency factors as a tensor; HF models take
# them from config.rope_scaling instead, which is not rebuilt here (we warn).
_IGNORED_TENSORS = frozenset({"rope_freqs.weight"})
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


# --------------------------------------------------------------------------
# Metadata -> Hugging Face config
# --------------------------------------------------------------------------


def _field(header: GGUFHeader, key: str, default: Any = None) -> Any:
    return header.fields.get(key, default)


def _architecture(header: GGUFHeader, path: str) -> str:
    arch = _field(header, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} in {path} is not supported; "
            f"supported architectures: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    return arch


def _rope_scaling(header: GGUFHeader, arch: str, path: str) -> dict[str, Any] | None:
    kind = _field(header, f"{arch}.rope.scaling.type")
    factor = _field(header, f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind != "linear":
        raise ValueError(
            f"GGUF file {path} uses RoPE scaling {kind!r}; only linear scaling is supported"
        )
    return {"rope_type": "linear", "factor": float(factor)}


def _torch_dtype_name(header: GGUFHeader) -> str:
    file_type = _field(header, "general.file_type")
    if file_type == LlamaFileType.ALL_F32:
        return "float32"
    if file_type == LlamaFileType.MOSTLY_F16:
        return "float16"
    # bf16 files, and quantized ones: bf16 keeps the activations' range.
    return "bfloat16"


def _hf_config(header: GGUFHeader, arch: str, path: str) -> dict[str, Any]:
    names = {t.name for t in header.tensors}
    required = ("embedding_length", "attention.head_count", "block_count")
    missing = [f"{arch}.{k}" for k in required if f"{arch}.{k}" not in header.fields]
    if missing:
        raise corrupt_file_error(path, f"metadata lacks {', '.join(missing)}")
    hidden = _field(header, f"{arch}.embedding_length")
    heads = _field(header, f"{arch}.attention.head_count")
    vocab = _field(header, f"{arch}.vocab_size")
    if vocab is None:
        tokens = header.fields.get("tokenizer.ggml.tokens")
        vocab = tokens.count if isinstance(tokens, ArrayValue) else None
    return {
        "architectures": [_HF_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": _field(header, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _field(header, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(header, f"{arch}.attention.head_count_kv", heads),
        "head_dim": _field(header, f"{arch}.attention.key_length", hidden // heads),
        "hidden_act": "silu",
        "rms_norm_eps": _field(header, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": _field(header, f"{arch}.rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(header, arch, path),
        "max_position_embeddings": _field(header, f"{arch}.context_length"),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": any(n.endswith(".attn_q.bias") for n in names),
        "bos_token_id": _field(header, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(header, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": _torch_dtype_name(header),
    }


# --------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _TensorSpec:
    hf_name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order
    data: np.ndarray  # raw bytes (a view of the memory map)
    rope_heads: int  # > 0: undo llama.cpp's RoPE row permutation over this many heads


def _hf_tensor_name(gguf_name: str, n_layers: int) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_TENSORS or int(m.group(1)) >= n_layers:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.{m.group(3)}"


def _rope_heads(gguf_name: str, arch: str, cfg: dict[str, Any]) -> int:
    # llama.cpp's converter interleaves the q/k rows of `llama` models for its
    # RoPE kernel; Qwen models are stored in HF's rotate-half order already.
    if arch != "llama":
        return 0
    if ".attn_q." in gguf_name:
        return cfg["num_attention_heads"]
    if ".attn_k." in gguf_name:
        return cfg["num_key_value_heads"]
    return 0


def _tensor_specs(header: GGUFHeader, data: np.ndarray, arch: str, cfg: dict[str, Any],
                  path: str) -> tuple[_TensorSpec, ...]:
    specs = []
    for t in header.tensors:
        if t.name in _IGNORED_TENSORS:
            logger.warning("%s: ignoring %s (RoPE frequency factors are not applied)", path, t.name)
            continue
        hf_name = _hf_tensor_name(t.name, cfg["num_hidden_layers"])
        if hf_name is None:
            raise ValueError(
                f"GGUF file {path} has tensor {t.name!r}, which does not belong to a "
                f"{arch} model as astream knows it; the file may be for another architecture"
            )
        if t.qtype not in SUPPORTED_QUANT_TYPES:
            raise unsupported_type_error(path, t.name, t.qtype.name)
        shape = tuple(reversed(t.dims))
        raw = data[t.offset:t.offset + t.nbytes]
        specs.append(_TensorSpec(hf_name, t.qtype, shape, raw, _rope_heads(t.name, arch, cfg)))
    return tuple(specs)


def _unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Per head, rows [r0 i0, r0 i1, r1 i0, ...] (interleaved pairs) -> [r0.., r1..] (halves)."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"cannot split {rows} rows into {n_heads} RoPE heads")
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


@dataclass(slots=True)
class GGUFCheckpoint:
    """A GGUF model file opened for loading; tensors come out in HF names and shapes."""

    path: str
    hf_config: dict
    header: GGUFHeader | None = field(default=None, repr=False)   # parsed once, kept for the tokenizer
    _specs: tuple[_TensorSpec, ...] = field(default=(), repr=False)
    _data: np.ndarray | None = field(default=None, repr=False)  # the memory map the specs view

    def tensor_names(self) -> list[str]:
        return [s.hf_name for s in self._specs]

    def iter_tensors(
        self, dtype: torch.dtype, device: torch.device | str, shard: TPShard | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, tensor) one at a time, dequantized on `device`. With `shard`, only
        the quantization blocks that hold the rank's part are read and dequantized."""
        for spec in self._specs:
            where = None if shard is None else shard.slice_of(spec.hf_name)
            if where is None:
                yield spec.hf_name, _read_whole(spec, dtype, device)
            else:
                yield spec.hf_name, pad_rows(_read_part(spec, where, dtype, device), where)


def _dequantize(raw: np.ndarray, spec: _TensorSpec, shape: tuple[int, ...], dtype: torch.dtype,
                device: torch.device | str) -> torch.Tensor:
    return dequantize(torch.from_numpy(raw).to(device), spec.qtype, shape, dtype)


def _read_whole(spec: _TensorSpec, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    w = _dequantize(spec.data, spec, spec.shape, dtype, device)
    return _unpermute_rope_rows(w, spec.rope_heads) if spec.rope_heads else w


def _read_part(spec: _TensorSpec, where: Slice, dtype: torch.dtype,
               device: torch.device | str) -> torch.Tensor:
    part = block_slice(spec.data, spec.qtype, spec.shape, where)
    heads = _rope_heads_in(spec, where)
    if part is None or heads is None:
        # block_slice cuts only one- and two-dimensional tensors, and llama's RoPE row
        # order can be undone only over whole heads; slices beyond those (no TPShard asks
        # for one) need the whole tensor dequantized first.
        w = _read_whole(spec, dtype, device)
        return w.narrow(where.dim, where.start, where.stop - where.start)
    w = _dequantize(part.raw, spec, part.shape, dtype, device).narrow(part.dim, part.skip,
                                                                      part.length)
    # The RoPE permutation moves rows only within a head, so a slice of whole heads holds
    # the same file rows before and after it.
    return _unpermute_rope_rows(w, heads) if heads else w


def _rope_heads_in(spec: _TensorSpec, where: Slice) -> int | None:
    """RoPE heads in the rows `where` selects (0: no permutation); None: not whole heads."""
    if not spec.rope_heads:
        return 0
    head_rows = spec.shape[0] // spec.rope_heads
    if where.dim != 0 or where.start % head_rows or where.stop % head_rows:
        return None
    return (where.stop - where.start) // head_rows


def read_gguf(path: str | os.PathLike) -> GGUFCheckpoint:
    """Open a GGUF file, validate it, and map its metadata and tensors to HF form."""
    path = check_gguf_path(path)
    header = read_header(path)
    arch = _architecture(header, path)
    cfg = _hf_config(header, arch, path)
    # Copy-on-write: views are writable (torch.from_numpy needs that) while the file
    # itself can never be modified.
    data = np.memmap(path, dtype=np.uint8, mode="c")
    specs = _tensor_specs(header, data, arch, cfg, path)
    return GGUFCheckpoint(path=path, hf_config=cfg, header=header, _specs=specs, _data=data)
