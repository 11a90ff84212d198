"""Faults and cancellations stay where they happen: the caller's code, other requests and
the engine's bookkeeping are never hurt."""

from __future__ import annotations

import anyio
import pytest

from astream import Engine, EngineClosedError, PromptTooLongError, SamplingParams
from astream.core.engine_core import EngineCore
from astream.executor.runner import ModelRunner

ENGINE_KW = dict(device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=1024)
GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def settle(engine: Engine, idle_free: int) -> dict:
    """Wait until the engine holds no request and every block is free again."""
    stats = engine.stats()
    with anyio.move_on_after(20):
        while stats["requests"] or stats["kv_blocks_free"] != idle_free or stats["running"]:
            await anyio.sleep(0.01)
            stats = engine.stats()
    return stats


@pytest.mark.anyio
async def test_an_engine_fault_never_cancels_the_callers_code(monkeypatch):
    def broken_process(self, output):
        raise RuntimeError("bug in output processing")

    reached = []
    async with Engine(**ENGINE_KW) as engine:
        monkeypatch.setattr(EngineCore, "process", broken_process)
        out = await engine.generate("Hello", GREEDY)
        assert out.finish_reason == "error" and "bug in output processing" in out.error
        await anyio.sleep(0.05)                     # a checkpoint after the fault: not cancelled
        reached.append("inside")
        with pytest.raises(EngineClosedError):
            await engine.generate("again", GREEDY)
        assert engine.stats()["fault"] and not engine.running
    reached.append("after")
    assert reached == ["inside", "after"]


@pytest.mark.anyio
async def test_the_callers_own_exception_leaves_the_block_unchanged():
    with pytest.raises(KeyError, match="mine"):
        async with Engine(**ENGINE_KW):
            raise KeyError("mine")


@pytest.mark.anyio
async def test_a_fault_while_preparing_a_step_ends_only_that_request(monkeypatch):
    original = ModelRunner.prepare

    def faulty_prepare(self, batch):
        if any(item.seq.params.top_k == 31337 for item in batch.items):
            raise OverflowError("injected: a value that cannot become a tensor")
        return original(self, batch)

    monkeypatch.setattr(ModelRunner, "prepare", faulty_prepare)
    async with Engine(**ENGINE_KW) as engine:
        idle_free = engine.stats()["kv_blocks_free"]
        expected = await engine.generate("The quick brown fox", GREEDY)
        results = {}

        async def run(name, params):
            results[name] = await engine.generate("The quick brown fox", params)

        async with anyio.create_task_group() as group:
            for i in range(4):
                group.start_soon(run, i, GREEDY)
            group.start_soon(run, "poison", SamplingParams(temperature=1, top_k=31337, max_tokens=6))
        assert results["poison"].finish_reason == "error" and "injected" in results["poison"].error
        for i in range(4):
            assert results[i].token_ids == expected.token_ids
        assert engine.running
        await settle(engine, idle_free)


@pytest.mark.anyio
async def test_cancelling_at_every_await_point_leaves_nothing_registered():
    async with Engine(**ENGINE_KW) as engine:
        idle_free = engine.stats()["kv_blocks_free"]

        async def consume_stream():
            async for _ in engine.stream("Hello", GREEDY):
                pass

        async def consume_request():
            async with await engine.request("Hello", GREEDY) as request:
                async for _ in request:
                    pass

        async def consume_generate():
            await engine.generate("Hello", GREEDY)

        for consume in (consume_stream, consume_request, consume_generate):
            for checkpoints in range(30):
                async with anyio.create_task_group() as group:
                    group.start_soon(consume)
                    for _ in range(checkpoints):
                        await anyio.lowlevel.checkpoint()
                    group.cancel_scope.cancel()
        stats = await settle(engine, idle_free)
        assert stats["requests"] == 0 and stats["kv_blocks_free"] == idle_free
        assert stats["running"] == 0 and stats["waiting"] == 0


@pytest.mark.anyio
async def test_an_unread_request_stream_closed_early_is_aborted():
    async with Engine(**ENGINE_KW) as engine:
        idle_free = engine.stats()["kv_blocks_free"]
        request = await engine.request("Tell me a story.", SamplingParams(max_tokens=200))
        await request.aclose()                      # never iterated
        assert request.finish_reason == "abort"
        await settle(engine, idle_free)


@pytest.mark.anyio
async def test_a_prompt_too_large_to_fit_is_refused_without_tokenizing(monkeypatch):
    def no_tokenizing(self, prompt):
        raise AssertionError("tokenized")

    async with Engine(**ENGINE_KW) as engine:
        monkeypatch.setattr(EngineCore, "tokenize", no_tokenizing)
        with pytest.raises(PromptTooLongError, match="max_model_len is 1024"):
            await engine.generate("word " * 20_000, GREEDY)
        with pytest.raises(PromptTooLongError):
            await engine.generate([{"role": "user", "content": "x" * 100_000}], GREEDY)
        assert engine.stats()["requests"] == 0
