"""GGUF dequantization in torch against gguf's numpy reference, for every supported type."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from astream.models.dequant import SUPPORTED_QUANT_TYPES, dequantize
from astream.models.gguf_loader import SUPPORTED_GGUF_TENSOR_TYPES

QUANTIZABLE = (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1)  # gguf.quants.quantize supports these
# Byte offsets of the fp16 fields in one block, per type.
FP16_FIELDS = {
    QT.Q8_0: (0,), QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2),
    QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (GGML_QUANT_SIZES[QT.Q6_K][1] - 2,),
}

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
