"""KV offload on the CPU: the real paging, ring, staging, tail and policy-hook logic."""

from __future__ import annotations

import anyio
import pytest
import torch

from astream import LLM, Engine, SamplingParams
from astream.policies import PolicyRuntime, PolicyTraits, SparsePolicy
from tests.conftest import PROMPTS

# Small blocks, slots and budgets so a short prompt already crosses every path:
# chunked prefill, several ring jobs per layer, tails filling up during decode.
OFFLOAD_KW = dict(device="cpu", dtype="float32", offload=True, kv_block_size=16, num_kv_blocks=512,
                  max_model_len=1024, offload_slot_tokens=48, max_num_batched_tokens=40)
GREEDY_64 = SamplingParams(temperature=0.0, max_tokens=64)


@pytest.fixture(scope="module")
def offload_llm():
    llm = LLM(**OFFLOAD_KW)
    yield llm
    llm.close()


def test_offload_gives_the_same_tokens_as_resident(smol_llm, offload_llm):
    resident = smol_llm.generate(PROMPTS, GREEDY_64)
    offloaded = offload_llm.generate(PROMPTS, GREEDY_64)
    for prompt, a, b in zip(PROMPTS, resident, offloaded):
        assert b.token_ids == a.token_ids, f"prompt {prompt!r}"
    stats = offload_llm.stats()
    assert stats["offload_bytes_loaded"] > 0 and stats["offload_bytes_offloaded"] > 0


def test_batch_of_six_lengths_with_offload(smol_llm, offload_llm):
    prompts = [" ".join(["word"] * n) for n in (1, 7, 16, 33, 70, 150)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    assert [o.token_ids for o in offload_llm.generate(prompts, params)] == \
        [o.token_ids for o in smol_llm.generate(prompts, params)]


def test_prompt_longer_than_the_ring(smol_llm, offload_llm):
    prompt = "Here is a long list of fruit: " + ", ".join(["apple", "pear", "plum", "fig"] * 40)
    ids = offload_llm.tokenizer(prompt)["input_ids"]
    assert len(ids) > 3 * OFFLOAD_KW["offload_slot_tokens"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    assert offload_llm.generate([prompt], params)[0].token_ids == \
        smol_llm.generate([prompt], params)[0].token_ids


def test_random_qwen3_offload_matches_resident(tiny_qwen3):
    prompt = [5, 17, 923, 4411, 8, 77, 1000, 12, 3, 250, 31, 64, 7] * 5
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with LLM(str(tiny_qwen3), device="cpu", num_kv_blocks=64) as resident, \
            LLM(str(tiny_qwen3), device="cpu", offload=True, kv_block_size=16, num_kv_blocks=64,
                offload_slot_tokens=32, max_num_batched_tokens=24) as offloaded:
        assert offloaded.generate([prompt], params)[0].token_ids == \
            resident.generate([prompt], params)[0].token_ids


def test_small_host_pool_makes_requests_wait_without_corruption(smol_llm):
    prompts = [f"Count from {i} to {i + 50}:" for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    expected = [o.token_ids for o in smol_llm.generate(prompts, params)]
    with LLM(**{**OFFLOAD_KW, "num_kv_blocks": 12, "max_model_len": 192}) as small:
        assert [o.token_ids for o in small.generate(prompts, params)] == expected
        stats = small.stats()
        assert stats["preemptions"] > 0
        assert stats["kv_blocks_free"] == 12
        with pytest.raises(ValueError, match="max_model_len"):
            small.generate([list(range(100, 300))], params)


class RecordingPolicy(SparsePolicy):
    """Records every key the engine shows a policy, with its cache slot."""

    name = "recording"

    def __init__(self) -> None:
        self.calls: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def bind(self, layout) -> PolicyRuntime:
        calls = self.calls

        class Recorder(PolicyRuntime):
            def on_kv_written(self, layer, keys, slots) -> None:
                calls.append((layer, slots.clone(), keys.clone()))

        return Recorder(traits=PolicyTraits(watches_keys=True))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("offload", [True, False], ids=["offload", "resident"])
def test_policy_sees_every_new_key_once_per_layer_where_it_is_stored(offload, kv_cache_dtype):
    """...as the cache stores it: with fp8 KV, the fp8 key (value / scale)."""
    policy = RecordingPolicy()
    prompts = ["A" + " story" * n for n in (10, 40, 75)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    with LLM(**{**OFFLOAD_KW, "offload": offload, "sparse_policy": policy,
                "kv_cache_dtype": kv_cache_dtype}) as llm:
        outs = llm.generate(prompts, params)
        layers, bs = llm.core.model.decoder.config.num_layers, 16
        computed = sum(len(o.prompt_token_ids) + len(o.token_ids) - 1 for o in outs)
        written = {layer: set() for layer in range(layers)}
        for layer, slots, _ in policy.calls:
            written[layer].update(slots.tolist())
        assert all(len(w) == computed for w in written.values())
        assert len(policy.calls) == layers * sum(1 for _ in policy.calls if _[0] == 0)
        for layer, slots, keys in policy.calls:
            for slot, key in zip(slots.tolist(), keys):
                block, offset = divmod(slot, bs)
                if not offload:
                    stored = llm.core.runner.cache.k[layer][block, offset]
                elif all(s in written[layer] for s in range(block * bs, block * bs + bs)):
                    stored = llm.core.runner.offload.host_k[layer][block, :, offset]   # head-major
                else:
                    continue            # a partial block: still in its device tail
                assert stored.dtype == key.dtype == llm.core.runner.kv_format.dtype
                assert torch.equal(stored.view(torch.uint8), key.view(torch.uint8))


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
@pytest.mark.anyio
async def test_stream_cancel_and_abort_free_host_and_device_blocks(smol_llm):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = smol_llm.generate(["Tell me about the moon."], params)[0].token_ids
    async with Engine(**OFFLOAD_KW) as engine:
        idle = engine.stats()["kv_blocks_free"]
        results = {}

        async def full(name):
            results[name] = [t.token_id async for t in engine.stream("Tell me about the moon.", params)]

        async def leave(name):
            async for tok in engine.stream("Tell me about the sun.", params, request_id=name):
                if tok.index == 5:
                    break

        async def aborted(name):
            async for tok in engine.stream("Tell me about stars.", params, request_id=name):
                if tok.index == 3:
                    await engine.abort(name)
            results[name] = tok.finish_reason

        async with anyio.create_task_group() as group:
            group.start_soon(full, "full")
            group.start_soon(leave, "leave")
            group.start_soon(aborted, "aborted")
        assert results["full"] == expected
        assert results["aborted"] == "abort"
        for _ in range(100):
            if engine.stats()["kv_blocks_free"] == idle:
                break
            await anyio.sleep(0.01)
        stats = engine.stats()
        assert stats["kv_blocks_free"] == idle and stats["offload_tail_blocks_used"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_host_tensor_pins_exactly_its_size_until_released():
    from astream.runtime.pinned import PinnedHostTensor
    odd = PinnedHostTensor((3, 1000, 7), torch.bfloat16, pin=True)    # 42,000 bytes, not a power of 2
    assert odd.tensor.is_pinned() and odd.tensor.untyped_storage().nbytes() == 42000
    odd.tensor.copy_(torch.randn(3, 1000, 7))
    view = odd.tensor[1]
    copied = view.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(copied.cpu(), view)
    odd.release()
    assert not odd.tensor.is_pinned()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_pool_is_unpinned_when_the_engine_closes(tiny_qwen3):
    with LLM(str(tiny_qwen3), device="cuda", dtype="bfloat16", offload=True, kv_block_size=16,
             num_kv_blocks=100, offload_slot_tokens=32) as llm:
        pool = llm.engine.core.runner.offload.host_pool
        assert pool.tensor.is_pinned()
        out = llm.generate([[5, 17, 923, 4411] * 20], SamplingParams(temperature=0.0, max_tokens=8))
        assert len(out[0].token_ids) == 8
    assert not pool.tensor.is_pinned()


def test_ring_slot_cut_by_memory_holds_whole_1024_token_runs(monkeypatch):
    """A ring slot sized by the device memory left keeps the shape cuDNN attention takes
    (whole 1,024-token runs), so a full slot's prefill part is not sent to a slower kernel."""
    from astream.kvcache import sizing
    from astream.models.config import ModelConfig
    model = ModelConfig.from_hf(dict(
        model_type="qwen3", vocab_size=1000, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=1 << 20))
    layer_block_bytes = model.kv_bytes_per_token // model.num_layers * 16 * 2
    spec = sizing.CacheSpec(block_size=16, max_num_seqs=4, offload=True, num_kv_blocks=1 << 16,
                            max_model_len=1 << 20, max_num_batched_tokens=8192,
                            offload_ring_slots=3)
    fixed = (2 * (8192 // 16 + 1) + model.num_layers * 5) * layer_block_bytes
    for spare_blocks, want in ((100, 64), (130, 128), (1000, 960), (63, 63), (5, 5)):
        # Each slot block costs its 3 slots' blocks and its copy in the model's dtype (a
        # prefill part's context formed from one slot: `prefill_context`).
        free = fixed + spare_blocks * 4 * layer_block_bytes
        monkeypatch.setattr(sizing, "_free_device_bytes", lambda *args, free=free: free)
        plan = sizing.plan_cache(spec, model, torch.bfloat16, torch.device("cuda"))
        assert plan.offload.slot_blocks == want
