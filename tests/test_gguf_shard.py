"""A tensor-parallel rank reads only its shard's blocks from a GGUF file, and gets the same
bits as dequantizing the whole tensor and cutting it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

import astream.models.gguf_loader as gguf_loader
from astream.models.config import ModelConfig
from astream.models.dequant import SUPPORTED_QUANT_TYPES, quantized_nbytes
from astream.models.gguf_loader import read_gguf
from astream.models.tensor_parallel import Slice, TPShard
from tests.test_gguf_dequant import FP16_FIELDS, quantized_random, random_blocks
from tests.test_gguf_files import write_gguf

HIDDEN, HEAD_DIM, FFN, VOCAB = 256, 128, 768, 16


def _raw(qtype: QT, rows: int, cols: int, rng: np.random.Generator):
    if qtype in FP16_FIELDS:
        block, type_size = GGML_QUANT_SIZES[qtype]
        return random_blocks(qtype, rows * cols // block, rng).reshape(rows, -1), qtype
    return quantized_random(qtype, (rows, cols), rng).reshape(rows, -1), qtype


def _tiny_llama(tmp_path, qtype: QT, heads: int, kv_heads: int):
    """Every matrix stored as `qtype`; q/k rows (and biases) in llama.cpp's RoPE order. FFN
    is three K-quant blocks wide, so two ranks cut down_proj's rows inside a block."""
    rng = np.random.default_rng(int(qtype))
    q_rows, kv_rows = heads * HEAD_DIM, kv_heads * HEAD_DIM
    shapes = {"token_embd": (VOCAB, HIDDEN), "output": (VOCAB, HIDDEN),
              "blk.0.attn_q": (q_rows, HIDDEN), "blk.0.attn_k": (kv_rows, HIDDEN),
              "blk.0.attn_v": (kv_rows, HIDDEN), "blk.0.attn_output": (HIDDEN, q_rows),
              "blk.0.ffn_gate": (FFN, HIDDEN), "blk.0.ffn_up": (FFN, HIDDEN),
              "blk.0.ffn_down": (HIDDEN, FFN)}
    tensors = {f"{name}.weight": _raw(qtype, *shape, rng) for name, shape in shapes.items()}
    for name, rows in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows)):
        tensors[f"blk.0.{name}.bias"] = rng.standard_normal(rows).astype(np.float32)
    for name in ("blk.0.attn_norm", "blk.0.ffn_norm", "output_norm"):
        tensors[f"{name}.weight"] = rng.standard_normal(HIDDEN).astype(np.float32)
    kv = {"llama.block_count": 1, "llama.context_length": 256, "llama.embedding_length": HIDDEN,
          "llama.feed_forward_length": FFN, "llama.attention.head_count": heads,
          "llama.attention.head_count_kv": kv_heads, "llama.attention.key_length": HEAD_DIM,
          "llama.attention.layer_norm_rms_epsilon": 1e-6,
          "tokenizer.ggml.tokens": [f"t{i}" for i in range(VOCAB)]}
    return write_gguf(tmp_path / f"{qtype.name}.gguf", "llama", tensors, kv)


class _DequantizeLog:
    """Wraps the loader's dequantize and records the bytes and shape each call was given."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[int, tuple[int, ...], QT]] = []
        real = gguf_loader.dequantize

        def log(data, qtype, shape, dtype=torch.float32):
            self.calls.append((data.numel(), tuple(shape), QT(qtype)))
            return real(data, qtype, shape, dtype)

        monkeypatch.setattr(gguf_loader, "dequantize", log)


def _shard_bytes(qtype: QT, shape: tuple[int, ...], where) -> int:
    """The bytes a rank's slice spans: its rows, or its columns widened to whole blocks."""
    if where is None:
        return quantized_nbytes(qtype, shape)
    block = GGML_QUANT_SIZES[qtype][0]
    if where.dim == len(shape) - 1:
        first, end = where.start // block, -(-where.stop // block)
        return quantized_nbytes(qtype, (*shape[:-1], (end - first) * block))
    return quantized_nbytes(qtype, (where.stop - where.start, *shape[1:]))


def _check_ranks(path, sizes, monkeypatch, dtype=torch.float32):
    checkpoint = read_gguf(path)
    config = ModelConfig.from_hf(checkpoint.hf_config)
    whole = dict(checkpoint.iter_tensors(dtype, "cpu"))
    types = {s.hf_name: (s.qtype, s.shape) for s in checkpoint._specs}
    for size in sizes:
        for rank in range(size):
            shard = TPShard(rank, size, config)
            log = _DequantizeLog(monkeypatch)
            got = dict(checkpoint.iter_tensors(dtype, "cpu", shard))
            monkeypatch.undo()
            assert got.keys() == whole.keys()
            for (name, tensor), (nbytes, _, qtype) in zip(got.items(), log.calls, strict=True):
                want = shard.take(name, whole[name])
                assert tensor.dtype == want.dtype and tensor.shape == want.shape, name
                assert torch.equal(tensor, want), f"{name}, rank {rank} of {size}"
                assert tensor.is_contiguous()
                assert qtype == types[name][0]
                assert nbytes == _shard_bytes(qtype, types[name][1], shard.slice_of(name)), name


@pytest.mark.parametrize("qtype", SUPPORTED_QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("heads,kv_heads,sizes", [(6, 1, (2, 3)), (4, 2, (2, 4))],
                         ids=["kv-replicated", "kv-split"])
def test_each_rank_dequantizes_only_its_blocks_and_gets_the_cut_tensors_bits(
        tmp_path, monkeypatch, qtype, heads, kv_heads, sizes):
    _check_ranks(_tiny_llama(tmp_path, qtype, heads, kv_heads), sizes, monkeypatch)


def test_smollm2_shards_match_and_read_a_third_of_each_split_tensor(smollm2_path, monkeypatch):
    """Q4_1 matrices and a Q8_0 embedding; 9 query and 3 KV heads (RoPE-permuted q/k) split
    over 3 ranks only."""
    _check_ranks(smollm2_path, (3,), monkeypatch, torch.bfloat16)


def test_a_block_slice_is_a_strided_view_of_the_file(tmp_path):
    """No copy before dequantizing: the bytes come straight from the memory map."""
    checkpoint = read_gguf(_tiny_llama(tmp_path, QT.Q4_K, 4, 2))
    spec = next(s for s in checkpoint._specs if s.hf_name.endswith("down_proj.weight"))
    where = TPShard(1, 2, ModelConfig.from_hf(checkpoint.hf_config)).slice_of(spec.hf_name)
    part = gguf_loader.block_slice(spec.data, spec.qtype, spec.shape, where)
    assert np.shares_memory(part.raw, checkpoint._data)
    assert part.shape == (HIDDEN, 2 * 256) and (part.skip, part.length) == (128, 384)


def test_rope_rows_cut_inside_a_head_are_read_whole_and_cut(tmp_path):
    checkpoint = read_gguf(_tiny_llama(tmp_path, QT.Q8_0, 4, 2))
    spec = next(s for s in checkpoint._specs if s.hf_name.endswith("q_proj.weight"))
    whole = dict(checkpoint.iter_tensors(torch.float32, "cpu"))[spec.hf_name]
    where = Slice(0, HEAD_DIM // 2, 3 * HEAD_DIM // 2)
    got = gguf_loader._read_part(spec, where, torch.float32, "cpu")
    assert torch.equal(got, whole[where.start:where.stop])
