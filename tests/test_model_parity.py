"""astream's decoder against transformers: logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch

from astream import LLM, SamplingParams
from astream.ops.attention import VarlenMeta, varlen_attention
from tests.conftest import PROMPTS

GREEDY_32 = SamplingParams(temperature=0.0, max_tokens=32)


def hf_greedy(model, prompt_ids: list[int], n: int, eos: set[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                             dtype=torch.long), max_new_tokens=n, do_sample=False,
                             eos_token_id=sorted(eos), pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def prefill_logits(llm: LLM, prompt_ids: list[int]) -> torch.Tensor:
    """Logits at every prompt position: the engine's decoder with its varlen attention op."""
    decoder = llm.core.model.decoder
    n = len(prompt_ids)
    meta = VarlenMeta(torch.tensor([0, n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32),
                      n, n, [0, n], [0, n])
    scale = decoder.config.head_dim ** -0.5

    def attend(layer, q, k, v):
        return varlen_attention(q, k, v, meta, causal=True, scale=scale)[0]

    with torch.inference_mode():
        hidden = decoder.forward(torch.tensor(prompt_ids), torch.arange(n), attend)
        return decoder.logits(hidden)


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name,
                                                dtype=torch.float32).eval()


def test_smollm2_greedy_matches_transformers(smol_llm, hf_smollm2):
    outs = smol_llm.generate(PROMPTS, GREEDY_32)
    eos = set(smol_llm.core.eos_ids)
    for prompt, out in zip(PROMPTS, outs):
        expected = hf_greedy(hf_smollm2, out.prompt_token_ids, 32, eos)
        assert out.token_ids == expected, f"prompt {prompt!r}"
    assert "Paris" in outs[-1].text


def test_chat_prompt_answers_paris(smol_llm):
    out = smol_llm.generate([[{"role": "user", "content": "What is the capital of France?"}]],
                            GREEDY_32)[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_tiny_random_model_matches_transformers(arch, request):
    from transformers import AutoModelForCausalLM
    folder = request.getfixturevalue(f"tiny_{arch}")
    llm = LLM(str(folder), device="cpu", dtype="float32", num_kv_blocks=64)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    prompt = [5, 17, 923, 4411, 8, 77, 1000, 12, 3, 250, 31, 64, 7]
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float()
    got = prefill_logits(llm, prompt)
    rel = (got - expected).norm() / expected.norm()
    assert rel < 1e-4, f"prefill logits relative error {rel:.2e}"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
    assert out.token_ids == hf_argmax_loop(hf, prompt, 32)


def hf_argmax_loop(model, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy decoding with no end-of-sequence handling at all."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "smollm2"])
def test_an_early_query_from_a_layers_own_residual_is_that_layers_query(arch, request):
    """Decoder.early_query(l, residual) is the query layer l computes from that residual
    (input norm, Q projection with its bias, Q norm, RoPE); given the residual entering
    layer l - 1 instead, it is the prefetch's prediction."""
    if arch == "smollm2":
        llm = request.getfixturevalue("smol_llm")
    else:
        llm = LLM(str(request.getfixturevalue(f"tiny_{arch}")), device="cpu", dtype="float32",
                  num_kv_blocks=64)
    decoder = llm.core.model.decoder
    prompt = torch.tensor([5, 17, 923, 4411, 8, 77, 1000, 12, 3])
    positions = torch.arange(40, 40 + len(prompt))
    residuals, queries = {}, {}

    def attend(layer, q, k, v):
        queries[layer] = q.clone()
        return torch.zeros_like(q)

    def lookahead(layer, hidden, at):
        assert at is positions
        residuals[layer] = hidden.clone()

    with torch.inference_mode():
        decoder.forward(prompt, positions, attend, lookahead)
        layers = decoder.config.num_layers
        assert sorted(residuals) == sorted(queries) == list(range(layers))
        for layer in range(layers):
            early = decoder.early_query(layer, residuals[layer], positions)
            torch.testing.assert_close(early, queries[layer], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(decoder.early_query(1, residuals[0], positions), queries[1])
