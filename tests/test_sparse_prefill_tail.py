"""The last `dense_tail` queries of each prefill chunk read every key they can see, exactly."""

from __future__ import annotations

import pytest
import torch

from astream import LLM, SamplingParams
from astream.ops.attention_ref import varlen_attention_ref
from astream.ops.varlen import VarlenMeta
from astream.policies import FlexPrefillPolicy, MInferencePolicy, XAttentionPolicy
from astream.policies.base import KVLayout

SPARSE = {
    "xattention": lambda tail: XAttentionPolicy(threshold=0.3, block_size=16, stride=4, dense_tail=tail),
    "minference": lambda tail: MInferencePolicy(vertical_size=4, slash_size=4, sink=1, local=2,
                                                block_size=16, scale_with_length=False,
                                                dense_tail=tail),
    "flexprefill": lambda tail: FlexPrefillPolicy(gamma=0.3, min_budget=0, block_size=16,
                                                  dense_tail=tail),
}


def _layout() -> KVLayout:
    return KVLayout(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, num_blocks=8,
                    block_size=16, dtype=torch.float32, device=torch.device("cpu"), offload=False,
                    key_dtype=torch.float32, max_num_seqs=1)


def _meta(n_q: int, n_k: int) -> VarlenMeta:
    return VarlenMeta(torch.tensor([0, n_q], dtype=torch.int32), torch.tensor([0, n_k], dtype=torch.int32),
                      n_q, n_k, [0, n_q], [0, n_k])


@pytest.mark.parametrize("name", SPARSE)
def test_only_the_tail_rows_become_exact(name):
    torch.manual_seed(0)
    n_q, n_k, tail = 96, 160, 24          # a chunk of 96 queries over a 64-token prefix and itself
    q, k, v = torch.randn(n_q, 4, 16), torch.randn(n_k, 2, 16), torch.randn(n_k, 2, 16)
    meta, scale = _meta(n_q, n_k), 16 ** -0.5
    sparse, _ = SPARSE[name](0).bind(_layout()).prefill_attention(0, q, k, v, meta, True, scale)
    mixed, mixed_lse = SPARSE[name](tail).bind(_layout()).prefill_attention(0, q, k, v, meta, True, scale)
    full, full_lse = varlen_attention_ref(q, k, v, meta, causal=True, scale=scale)

    assert not torch.allclose(sparse[-tail:], full[-tail:], atol=1e-3)      # the setting is sparse
    torch.testing.assert_close(mixed[:-tail], sparse[:-tail])
    torch.testing.assert_close(mixed[-tail:], full[-tail:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed_lse[-tail:], full_lse[-tail:], atol=1e-5, rtol=1e-5)


# The sparsest settings: each query block reads little more than its own diagonal.
SPARSEST = {
    "xattention": lambda tail: XAttentionPolicy(threshold=0.05, block_size=16, stride=4, dense_tail=tail),
    "minference": lambda tail: MInferencePolicy(vertical_size=1, slash_size=1, sink=0, local=1, last_q=16,
                                                block_size=16, scale_with_length=False,
                                                dense_tail=tail),
    "flexprefill": lambda tail: FlexPrefillPolicy(gamma=0.05, min_budget=0, block_size=16,
                                                  dense_tail=tail),
}


@pytest.mark.parametrize("name", SPARSEST)
def test_a_tail_covering_every_chunk_gives_fulls_answer(smol_llm, name):
    filler = " ".join(f"Item {i} weighs {i * 7 % 23} kilograms." for i in range(40))
    prompts = ["The secret word is pineapple. " + filler + " Repeat the secret word. The secret word is",
               filler[:400] + " The capital of France is"]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = [o.token_ids for o in smol_llm.generate(prompts, greedy)]
    kw = dict(device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=2048,
              max_num_batched_tokens=128)
    with LLM(**kw, sparse_policy=SPARSEST[name](0)) as llm:        # the far fact is out of sight
        assert [o.token_ids for o in llm.generate(prompts, greedy)][0] != want[0]
    with LLM(**kw, sparse_policy=SPARSEST[name](128)) as llm:
        assert [o.token_ids for o in llm.generate(prompts, greedy)] == want


def test_dense_tail_is_checked():
    for make in SPARSE.values():
        with pytest.raises(ValueError, match="dense_tail"):
            make(-1)
