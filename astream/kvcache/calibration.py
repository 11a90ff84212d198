"""FP8 KV scales, measured once when an engine is built.

One forward pass over a fixed English text (CALIBRATION_TEXT, about 500 tokens) records,
per layer and KV head, the largest key and value magnitudes; the scale maps that
magnitude times HEADROOM onto the format's largest number. Keys are measured by the norm
of each rotary pair, not element by element: RoPE turns a pair by an angle that grows
with the position, so at position 100,000 either element of a pair can reach the pair's
norm even when it never did in a short text; the pair norm does not depend on the
position. HEADROOM leaves room for content that runs larger than the text; beyond it a
value saturates (the format's largest number) instead of overflowing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from astream.kvcache.kv_format import KVFormat
from astream.models.decoder import Decoder
from astream.ops.attention import varlen_attention
from astream.ops.varlen import VarlenMeta

HEADROOM = 2.0
CALIBRATION_TOKENS = 512
CALIBRATION_TEXT = (
    "The harbour town woke before the sun. Fishermen checked their nets by lantern light, "
    "bakers pulled the first loaves from brick ovens, and the ferry captain read the tide "
    "tables twice, as she had every morning for thirty years. By seven the market square "
    "was loud with prices: 4.50 for a kilo of mackerel, 12 for the good olive oil, 0.80 for "
    "a bunch of parsley. A schoolteacher explained to a visitor that the lighthouse was "
    "built in 1874, rebuilt after the storm of 1953, and automated in 1991. The visitor "
    "wrote it down, asked where the train station was, and learned that trains ran every "
    "forty minutes except on Sundays. In the library, a student translated a passage about "
    "photosynthesis: light energy splits water, oxygen escapes, and the captured energy "
    "builds sugars from carbon dioxide. Someone else was debugging a program that sorted "
    "shipping records by date, printing `for row in rows: print(row['id'], row['date'])` "
    "to see which entries were out of order. At noon the bells rang, the square emptied, "
    "and the smell of grilled fish drifted over the water. "
)


def scaled_format(dtype: torch.dtype, compute_dtype: torch.dtype, num_layers: int,
                  kv_heads: int, device: torch.device, scale: float) -> KVFormat:
    """Every (layer, KV head) with the same fixed scale, for K and V alike."""
    k = torch.full((num_layers, kv_heads), float(scale), dtype=torch.float32, device=device)
    return KVFormat(dtype, compute_dtype, k, k.clone())


@torch.inference_mode()
def calibrate_format(decoder: Decoder, token_ids: list[int], dtype: torch.dtype) -> KVFormat:
    """Per-(layer, KV head) scales for storing KV as `dtype`, from one dense forward pass
    over `token_ids` (CALIBRATION_TEXT's tokens, as the engine calls it)."""
    cfg, device = decoder.config, decoder.device
    ids = torch.tensor(token_ids[:CALIBRATION_TOKENS], dtype=torch.int64, device=device)
    k_peak = torch.zeros(cfg.num_layers, cfg.num_kv_heads, dtype=torch.float32, device=device)
    v_peak = torch.zeros_like(k_peak)
    meta = VarlenMeta.single(len(ids), len(ids), device)
    scale = cfg.head_dim ** -0.5

    def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k_peak[layer] = pair_norms(k).amax(dim=(0, 2))
        v_peak[layer] = v.float().abs().amax(dim=(0, 2))
        return varlen_attention(q, k, v, meta, causal=True, scale=scale)[0]

    decoder.forward(ids, torch.arange(len(ids), device=device), attend)
    largest = torch.finfo(dtype).max
    return KVFormat(dtype, decoder.dtype, _scale_of(k_peak, largest), _scale_of(v_peak, largest))


def pair_norms(k: Tensor) -> Tensor:
    """[T, KVH, D] -> [T, KVH, D/2]: the norm of each rotate-half pair (i, i + D/2)."""
    half = k.shape[-1] // 2
    k = k.float()
    return torch.sqrt(k[..., :half].square() + k[..., half:].square())


def _scale_of(peak: Tensor, largest: float) -> Tensor:
    # A head that never produced a nonzero value (random test models) keeps scale 1.
    return torch.where(peak > 0, peak * HEADROOM / largest, torch.ones_like(peak))


def calibration_ids(tokenizer, vocab_size: int) -> list[int]:
    """CALIBRATION_TEXT's tokens, repeated to CALIBRATION_TOKENS (ids past the model's
    vocabulary, possible with a borrowed tokenizer, are dropped)."""
    ids = [i for i in tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False) if i < vocab_size]
    if not ids:
        ids = list(range(min(vocab_size, CALIBRATION_TOKENS)))
    return (ids * (CALIBRATION_TOKENS // len(ids) + 1))[:CALIBRATION_TOKENS]
