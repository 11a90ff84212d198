"""Loading llama / qwen2 / qwen3 checkpoints from GGUF files.

The file is read through `gguf.GGUFReader` (memory-mapped); tensors are
dequantized one at a time with torch (`astream.models.dequant`), on the device
the caller asks for, and renamed and reshaped to the Hugging Face layout.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, LlamaFileType

from astream.models.dequant import SUPPORTED_QUANT_TYPES, dequantize

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
SUPPORTED_GGUF_TENSOR_TYPES = tuple(t.name for t in SUPPORTED_QUANT_TYPES)

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
# Layout validation: walk the header ourselves, bounded by the file size.
# GGUFReader trusts every length field, so a truncated file fails deep inside
# numpy and a corrupt array count can make it loop for a very long time.
# --------------------------------------------------------------------------

_SCALAR_SIZES = MappingProxyType(
    {
        GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1,
        GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
        GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
        GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
    }
)
_MAX_DIMS = 4


class _LayoutError(Exception):
    """The file's own length fields point past its end or make no sense."""


class _Cursor:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> int:
        if n < 0 or self.pos + n > len(self.buf):
            raise _LayoutError(
                f"a field at byte {self.pos} needs {n} bytes but the file ends at byte {len(self.buf)}"
            )
        start, self.pos = self.pos, self.pos + n
        return start

    def u32(self) -> int:
        return struct.unpack_from("<I", self.buf, self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack_from("<Q", self.buf, self.take(8))[0]

    def string(self) -> bytes:
        n = self.u64()
        start = self.take(n)
        return self.buf[start : start + n]


def _skip_value(cur: _Cursor, raw_type: int) -> None:
    try:
        vtype = GGUFValueType(raw_type)
    except ValueError:
        raise _LayoutError(f"unknown metadata value type {raw_type} at byte {cur.pos}") from None
    if vtype == GGUFValueType.STRING:
        cur.take(cur.u64())
    elif vtype == GGUFValueType.ARRAY:
        item_type, count = cur.u32(), cur.u64()
        if item_type in _SCALAR_SIZES:
            cur.take(count * _SCALAR_SIZES[GGUFValueType(item_type)])
        else:
            for _ in range(count):  # each item takes >= 8 bytes, so this ends with the file
                _skip_value(cur, item_type)
    else:
        cur.take(_SCALAR_SIZES[vtype])


def _read_metadata_layout(cur: _Cursor) -> tuple[int, int]:
    """Check magic, version and key/values; return (tensor_count, alignment)."""
    start = cur.take(4)
    if cur.buf[start : start + 4] != b"GGUF":
        raise _LayoutError("it does not start with the GGUF magic bytes")
    version = cur.u32()
    if version & 0xFFFF == 0:
        raise _LayoutError("it is a big-endian GGUF file, which astream cannot read")
    if version not in (2, 3):
        raise _LayoutError(f"GGUF version {version} is not supported (2 and 3 are)")
    tensor_count, kv_count = cur.u64(), cur.u64()
    alignment = 32
    for _ in range(kv_count):
        key = cur.string()
        raw_type = cur.u32()
        if key == b"general.alignment" and raw_type == GGUFValueType.UINT32:
            alignment = cur.u32()
        else:
            _skip_value(cur, raw_type)
    if alignment <= 0 or alignment & (alignment - 1):
        raise _LayoutError(f"general.alignment {alignment} is not a power of two")
    return tensor_count, alignment


def _check_tensor_layout(cur: _Cursor, tensor_count: int, alignment: int) -> None:
    infos = []
    for _ in range(tensor_count):
        name = cur.string().decode("utf-8", errors="replace")
        n_dims = cur.u32()
        if n_dims > _MAX_DIMS:
            raise _LayoutError(f"tensor {name!r} claims {n_dims} dimensions")
        dims = [cur.u64() for _ in range(n_dims)]
        infos.append((name, dims, cur.u32(), cur.u64()))
    data_start = -(-cur.pos // alignment) * alignment
    for name, dims, raw_type, offset in infos:
        try:
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(raw_type)]
        except (ValueError, KeyError):
            raise _UnknownTensorType(name, raw_type) from None
        if dims and dims[0] % block_size:
            raise _LayoutError(f"tensor {name!r} has rows that do not fill whole blocks")
        end = data_start + offset + prod(dims) // block_size * type_size
        if end > len(cur.buf):
            raise _LayoutError(
                f"tensor {name!r} ends at byte {end} but the file has only {len(cur.buf)} bytes"
            )


class _UnknownTensorType(Exception):
    def __init__(self, name: str, raw_type: int) -> None:
        super().__init__(name, raw_type)
        self.name, self.raw_type = name, raw_type


def _corrupt(path: str, reason: object) -> ValueError:
    return ValueError(
        f"GGUF file {path} is truncated or corrupt ({reason}); download or convert it again"
    )


def _unsupported_type(path: str, tensor: str, type_name: str) -> ValueError:
    return ValueError(
        f"tensor {tensor!r} in {path} has GGUF type {type_name}, which astream cannot dequantize; "
        f"supported tensor types: {', '.join(SUPPORTED_GGUF_TENSOR_TYPES)} "
        "(re-quantize the model to one of them)"
    )


def _validate_layout(path: str) -> None:
    """Raise ValueError unless every header field and tensor lies inside the file."""
    if os.path.getsize(path) == 0:
        raise _corrupt(path, "the file is empty")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf)
        try:
            tensor_count, alignment = _read_metadata_layout(cur)
            _check_tensor_layout(cur, tensor_count, alignment)
        except _LayoutError as exc:
            raise _corrupt(path, exc) from None
        except _UnknownTensorType as exc:
            raise _unsupported_type(path, exc.name, f"id {exc.raw_type}") from None


def _check_path(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if not os.path.isfile(path):
        raise ValueError(f"GGUF path {path} is not a regular file")
    return path


def _open_reader(path: str) -> GGUFReader:
    _validate_layout(path)
    try:
        # Copy-on-write: numpy views are writable (torch.from_numpy needs
        # that) while the file itself can never be modified.
        return GGUFReader(path, "c")
    except OSError:
        raise
    except Exception as exc:  # any parse failure means a malformed file
        raise _corrupt(path, exc) from exc


# --------------------------------------------------------------------------
# Metadata -> Hugging Face config
# --------------------------------------------------------------------------


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    if f.types == [GGUFValueType.FLOAT32]:
        # Shortest float32 repr: 1e-05 rather than 9.999999747378752e-06.
        value = float(str(np.float32(value)))
    return value


def _architecture(reader: GGUFReader, path: str) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} in {path} is not supported; "
            f"supported architectures: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    return arch


def _rope_scaling(reader: GGUFReader, arch: str, path: str) -> dict[str, Any] | None:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind != "linear":
        raise ValueError(
            f"GGUF file {path} uses RoPE scaling {kind!r}; only linear scaling is supported"
        )
    return {"rope_type": "linear", "factor": float(factor)}


def _torch_dtype_name(reader: GGUFReader) -> str:
    file_type = _field(reader, "general.file_type")
    if file_type == LlamaFileType.ALL_F32:
        return "float32"
    if file_type == LlamaFileType.MOSTLY_F16:
        return "float16"
    # bf16 files, and quantized ones: bf16 keeps the activations' range.
    return "bfloat16"


def _hf_config(reader: GGUFReader, arch: str, path: str) -> dict[str, Any]:
    names = {t.name for t in reader.tensors}
    required = ("embedding_length", "attention.head_count", "block_count")
    missing = [f"{arch}.{k}" for k in required if f"{arch}.{k}" not in reader.fields]
    if missing:
        raise _corrupt(path, f"metadata lacks {', '.join(missing)}")
    hidden = _field(reader, f"{arch}.embedding_length")
    heads = _field(reader, f"{arch}.attention.head_count")
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else None
    return {
        "architectures": [_HF_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": _field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _field(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv", heads),
        "head_dim": _field(reader, f"{arch}.attention.key_length", hidden // heads),
        "hidden_act": "silu",
        "rms_norm_eps": _field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": _field(reader, f"{arch}.rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(reader, arch, path),
        "max_position_embeddings": _field(reader, f"{arch}.context_length"),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": any(n.endswith(".attn_q.bias") for n in names),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": _torch_dtype_name(reader),
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


def _tensor_specs(reader: GGUFReader, arch: str, cfg: dict[str, Any], path: str) -> tuple[_TensorSpec, ...]:
    specs = []
    for t in reader.tensors:
        if t.name in _IGNORED_TENSORS:
            logger.warning("%s: ignoring %s (RoPE frequency factors are not applied)", path, t.name)
            continue
        hf_name = _hf_tensor_name(t.name, cfg["num_hidden_layers"])
        if hf_name is None:
            raise ValueError(
                f"GGUF file {path} has tensor {t.name!r}, which does not belong to a "
                f"{arch} model as astream knows it; the file may be for another architecture"
            )
        if t.tensor_type not in SUPPORTED_QUANT_TYPES:
            raise _unsupported_type(path, t.name, t.tensor_type.name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        raw = np.asarray(t.data).reshape(-1).view(np.uint8)
        specs.append(_TensorSpec(hf_name, t.tensor_type, shape, raw, _rope_heads(t.name, arch, cfg)))
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
    _specs: tuple[_TensorSpec, ...] = field(default=(), repr=False)
    _reader: GGUFReader | None = field(default=None, repr=False)  # keeps the memory map open

    def tensor_names(self) -> list[str]:
        return [s.hf_name for s in self._specs]

    def iter_tensors(
        self, dtype: torch.dtype, device: torch.device | str
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, tensor) one at a time, dequantized on `device`."""
        for spec in self._specs:
            raw = torch.from_numpy(spec.data).to(device)
            w = dequantize(raw, spec.qtype, spec.shape, dtype)
            del raw
            if spec.rope_heads:
                w = _unpermute_rope_rows(w, spec.rope_heads)
            yield spec.hf_name, w


def read_gguf(path: str | os.PathLike) -> GGUFCheckpoint:
    """Open a GGUF file, validate it, and map its metadata and tensors to HF form."""
    path = _check_path(path)
    reader = _open_reader(path)
    arch = _architecture(reader, path)
    cfg = _hf_config(reader, arch, path)
    specs = _tensor_specs(reader, arch, cfg, path)
    return GGUFCheckpoint(path=path, hf_config=cfg, _specs=specs, _reader=reader)


def load_gguf_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """The tokenizer stored in a GGUF file, with its chat template, via transformers."""
    from transformers import AutoTokenizer

    path = _check_path(path)
    p = Path(path)
    try:
        tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    except Exception:
        _validate_layout(path)  # a malformed file gets our clear message instead
        raise
    if not tok.chat_template:
        template = _field(_open_reader(path), "tokenizer.chat_template")
        if template:
            tok.chat_template = template
    return tok
