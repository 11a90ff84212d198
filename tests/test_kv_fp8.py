"""FP8 KV cache: the format's error, its calibration, and the engine's tokens with it."""

from __future__ import annotations

import pytest
import torch

from astream import LLM, EngineConfig, SamplingParams
from astream.kvcache.calibration import HEADROOM, calibrate_format, calibration_ids, pair_norms
from astream.kvcache.kv_format import KVFormat
from astream.ops.attention import VarlenMeta, varlen_attention
from astream.policies import QuestPolicy
from tests.conftest import PROMPTS
from tests.test_model_parity import prefill_logits

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
GREEDY_32 = SamplingParams(temperature=0.0, max_tokens=32)


def scaled(dtype: torch.dtype, k_scale: torch.Tensor, v_scale: torch.Tensor) -> KVFormat:
    return KVFormat(dtype, torch.float32, k_scale.view(1, -1), v_scale.view(1, -1))


@pytest.mark.parametrize("dtype,mantissa_bits", [(E4M3, 3), (E5M2, 2)])
def test_quantize_then_dequantize_is_within_the_formats_rounding(dtype, mantissa_bits):
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(500, 3, 64, generator=gen) * torch.tensor([0.1, 3.0, 40.0]).view(1, 3, 1)
    v = torch.randn(500, 3, 64, generator=gen)
    top = torch.finfo(dtype).max
    fmt = scaled(dtype, k.abs().amax(dim=(0, 2)) * HEADROOM / top, v.abs().amax(dim=(0, 2)) * HEADROOM / top)
    stored_k, stored_v = fmt.quantize(0, k, v)
    assert stored_k.dtype == stored_v.dtype == dtype
    back_k, back_v = fmt.dequantize(0, stored_k, stored_v)
    for x, back, scale in ((k, back_k, fmt.k_scale[0]), (v, back_v, fmt.v_scale[0])):
        # Round to nearest: half a unit in the last place, relative; below the normal range the
        # spacing is absolute (the smallest subnormal times the scale).
        tiny = torch.finfo(dtype).smallest_normal * 2 ** -mantissa_bits
        bound = x.abs() * 2 ** -(mantissa_bits + 1) + tiny * scale.view(1, -1, 1)
        assert torch.all((back - x).abs() <= bound * 1.0001)


def test_out_of_range_values_saturate_instead_of_becoming_nan():
    fmt = scaled(E4M3, torch.ones(2), torch.ones(2))
    k = torch.tensor([[[1e6, -1e6]], [[500.0, -460.0]]]).expand(2, 2, 2)
    stored, _ = fmt.quantize(0, k, k)
    back = fmt.dequantize(0, stored, stored)[0]
    assert torch.isfinite(back).all()
    assert back.abs().max() == torch.finfo(E4M3).max


def test_kv_cache_dtype_option_is_checked_and_named():
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    assert EngineConfig(kv_cache_dtype="fp8_e5m2").kv_storage_dtype() == E5M2
    with pytest.raises(ValueError, match="kv_cache_dtype 'int4'.*fp8_e4m3"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_scale applies to an fp8"):
        EngineConfig(kv_cache_scale=0.5)
    for bad in (0, -1.0, float("nan"), float("inf"), "1", True):
        with pytest.raises(ValueError, match="kv_cache_scale must be"):
            EngineConfig(kv_cache_dtype="fp8", kv_cache_scale=bad)


def test_calibrated_scales_keep_keys_in_range_at_any_position(smol_llm):
    """The calibration text stores at most 1/HEADROOM of the range, and the same text at the
    end of the model's context (RoPE turns every key pair further) stays there too: key
    scales come from pair norms, which rotation keeps."""
    decoder = smol_llm.core.model.decoder
    ids = calibration_ids(smol_llm.tokenizer, decoder.config.vocab_size)
    fmt = calibrate_format(decoder, ids, E4M3)
    limit = torch.finfo(E4M3).max / HEADROOM
    assert torch.all(fmt.k_scale > 0) and torch.all(fmt.v_scale > 0)
    tokens, n = torch.tensor(ids), len(ids)
    cu = torch.tensor([0, n], dtype=torch.int32)
    meta = VarlenMeta(cu, cu, n, n, [0, n], [0, n])
    for offset in (0, decoder.rope.cos.shape[0] - n):
        peaks = []

        def attend(layer, q, k, v):
            peaks.append(max(float((k.float() / fmt.k_scale[layer].view(1, -1, 1)).abs().max()),
                             float((v.float() / fmt.v_scale[layer].view(1, -1, 1)).abs().max())))
            return varlen_attention(q, k, v, meta, causal=True, scale=0.125)[0]

        with torch.inference_mode():
            decoder.forward(tokens, torch.arange(len(ids)) + offset, attend)
        assert max(peaks) <= limit * 1.001, (offset, max(peaks))
    assert torch.equal(pair_norms(torch.tensor([[[3.0, 0.0, 4.0, 1.0]]])),
                       torch.tensor([[[5.0, 1.0]]]))


def test_fp8_greedy_tokens_match_fp32_except_at_near_ties(smol_llm):
    """SmolLM2 on the parity prompts: fp8 KV gives fp32's greedy tokens, or departs from them
    only where fp32's own top two logits were close."""
    expected = smol_llm.generate(PROMPTS, GREEDY_32)
    with LLM(kv_cache_dtype="fp8_e4m3", device="cpu") as llm:      # the fp32 run's device
        outs = llm.generate(PROMPTS, GREEDY_32)
    same = 0
    for prompt, want, got in zip(PROMPTS, expected, outs):
        a, b = want.token_ids, got.token_ids
        step = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), None)
        if step is None:
            assert len(a) == len(b)
            same += 1
            continue
        logits = prefill_logits(smol_llm, want.prompt_token_ids + a[:step])[-1]
        margin = float(logits[a[step]] - logits[b[step]])
        print(f"prompt {prompt!r}: first differs at token {step}, fp32 margin {margin:.3f}")
        assert 0 <= margin < 0.5, margin
    assert same >= 2


@pytest.mark.parametrize("policy", ["full", "quest"])
def test_fp8_offload_gives_the_resident_tokens(policy):
    # On the CPU both paths run the same reference kernels, so their tokens must agree exactly.
    kw = dict(kv_cache_dtype="fp8_e4m3", kv_block_size=16, num_kv_blocks=256, max_model_len=1024,
              device="cpu")
    if policy == "quest":
        kw["sparse_policy"] = QuestPolicy(budget_tokens=64, dense_layers=2)
    prompts = [*PROMPTS[:4], "Note: " + " the red box holds seven stones." * 20]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    results = {}
    for offload in (False, True):
        with LLM(**kw, offload=offload) as llm:
            results[offload] = [o.token_ids for o in llm.generate(prompts, params)]
            stats = llm.stats()
            assert stats["kv_cache_dtype"] == "float8_e4m3fn"
            assert stats["kv_blocks_free"] == 256
            if policy == "quest":
                assert sum(stats["quest_selections"]) > 0
                bounds = llm.core.runner.policy.bounds       # of the stored keys, in fp8
                assert bounds[1] is None and bounds[2][0].dtype == bounds[2][1].dtype == E4M3
    assert results[False] == results[True]


@pytest.mark.parametrize("policy", ["full", "quest"])
def test_fp8_stores_twice_the_blocks_of_bf16_in_the_same_memory(policy):
    """Quest's page bounds are in the cache's element type too, so they shrink with it."""
    blocks = {}
    for kv in ("bfloat16", "fp8_e5m2"):
        with LLM(kv_cache_dtype=kv, cpu_kv_cache_gib=0.25, device="cpu", sparse_policy=policy,
                 dtype="bfloat16") as llm:
            blocks[kv] = llm.stats()["kv_blocks_total"]
            assert llm.core.runner.cache.k[0].dtype == llm.core.config.kv_storage_dtype()
    assert blocks["fp8_e5m2"] == 2 * blocks["bfloat16"]


def test_a_fixed_scale_is_used_everywhere_and_a_cached_prefix_still_decodes():
    prompt = "Tell me a story about a lighthouse keeper. " * 3
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(kv_cache_dtype="fp8_e4m3", kv_cache_scale=0.05) as llm:
        fmt = llm.core.runner.kv_format
        assert torch.all(fmt.k_scale == 0.05) and torch.all(fmt.v_scale == 0.05)
        first = llm.generate([prompt], params)[0]
        again = llm.generate([prompt], params)[0]               # its prefix comes from the cache
        assert llm.stats()["prefix_cache_hits"] > 0
    assert again.token_ids == first.token_ids
    assert sum(ch.isalpha() for ch in first.text) > len(first.text) // 3, first.text
