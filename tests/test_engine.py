"""The async Engine: concurrent streams, cancellation, backpressure, faults, event loops."""

from __future__ import annotations

import anyio
import pytest

from astream import Engine, SamplingParams
from astream.executor.runner import ModelRunner
from astream.text.request_text import IncrementalDetokenizer
from async_backends import BACKENDS

ENGINE_KW = dict(device="cpu", dtype="float32", num_kv_blocks=512, max_model_len=2048)
PROMPTS = [f"Story {i}: once upon a time" if i % 2 else [{"role": "user", "content": f"Count to {i}."}]
           for i in range(16)]
PARAMS = [SamplingParams(temperature=0, max_tokens=12 + i % 5) if i % 3 == 0 else
          SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=12 + i % 5, ignore_eos=True)
          for i in range(16)]


@pytest.fixture(scope="module")
def expected(smol_llm):
    """What the offline API gives for each prompt alone."""
    return [smol_llm.generate([p], sp)[0] for p, sp in zip(PROMPTS, PARAMS)]


async def collect(engine: Engine, prompt, params, request_id=None):
    ids, text, reasons = [], "", []
    async for tok in engine.stream(prompt, params, request_id):
        if tok.token_id >= 0:
            ids.append(tok.token_id)
        text += tok.text
        reasons.append(tok.finish_reason)
    return ids, text, reasons


@pytest.mark.parametrize("anyio_backend", BACKENDS)
@pytest.mark.anyio
async def test_concurrent_streams_match_offline_generation(expected):
    results = {}
    async with Engine(**ENGINE_KW) as engine:
        async def run(i):
            results[i] = await collect(engine, PROMPTS[i], PARAMS[i])
        async with anyio.create_task_group() as group:
            for i in range(16):
                group.start_soon(run, i)
        assert engine.stats()["running"] == 0
    for i, out in enumerate(expected):
        ids, text, reasons = results[i]
        assert ids == out.token_ids, f"stream {i}"
        assert text == out.text
        assert reasons[:-1] == [None] * (len(reasons) - 1) and reasons[-1] == out.finish_reason


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
@pytest.mark.anyio
async def test_cancelling_half_the_streams_frees_their_blocks(expected):
    async with Engine(**ENGINE_KW) as engine:
        idle_free = engine.stats()["kv_blocks_free"]
        results = {}

        async def keep(i):
            results[i] = await collect(engine, PROMPTS[i], PARAMS[i])

        async def leave_early(i, how):
            count = 0
            async for _ in engine.stream(PROMPTS[i], PARAMS[i], request_id=f"r{i}"):
                count += 1
                if count == 3 and how == "break":
                    break
                if count == 3 and how == "abort":
                    await engine.abort(f"r{i}")

        async def cancel_task(i):
            with anyio.move_on_after(0.05 * i):
                await collect(engine, PROMPTS[i], PARAMS[i])

        async with anyio.create_task_group() as group:
            for i in range(0, 16, 2):
                group.start_soon(keep, i)
            for i in (1, 5, 9):
                group.start_soon(leave_early, i, "break")
            for i in (3, 7, 11):
                group.start_soon(leave_early, i, "abort")
            for i in (13, 15):
                group.start_soon(cancel_task, i)
        for _ in range(200):
            if engine.stats()["kv_blocks_free"] == idle_free and engine.stats()["requests"] == 0:
                break
            await anyio.sleep(0.01)
        assert engine.stats()["kv_blocks_free"] == idle_free
        assert engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0
    for i in range(0, 16, 2):
        assert results[i][0] == expected[i].token_ids, f"stream {i}"


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
@pytest.mark.anyio
async def test_stalled_consumer_does_not_delay_others(expected):
    bound = 4
    async with Engine(stream_buffer_tokens=bound, **ENGINE_KW) as engine:
        stalled_params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        steady_params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        stalled = engine.stream("Tell me about the sea.", stalled_params, request_id="stalled")
        first = await stalled.__anext__()                   # then stop reading
        assert first.index == 0
        steps_at = []
        async for tok in engine.stream("Tell me about mountains.", steady_params):
            steps_at.append(engine.stats()["steps"])
        assert len(steps_at) == 30
        assert steps_at[-1] - steps_at[0] <= len(steps_at) - 1 + 2, steps_at
        request = engine.core.requests["stalled"]
        assert request.paused
        assert request.sink.backlog <= bound + 2           # paused, not buffering without end
        rest = [tok async for tok in stalled]               # reading again resumes it
        assert [first.token_id] + [t.token_id for t in rest] == \
            (await engine.generate("Tell me about the sea.", stalled_params)).token_ids


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
@pytest.mark.anyio
async def test_fault_in_one_request_ends_only_that_request(expected, monkeypatch):
    poison = 31337
    original_forward = ModelRunner._forward

    def faulty_forward(self, inputs):
        if poison in inputs.input_ids.tolist():
            raise RuntimeError("injected step fault")
        return original_forward(self, inputs)

    original_push = IncrementalDetokenizer.push

    def faulty_push(self, token_id):
        if 31338 in self.ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        return original_push(self, token_id)

    monkeypatch.setattr(ModelRunner, "_forward", faulty_forward)
    monkeypatch.setattr(IncrementalDetokenizer, "push", faulty_push)
    results = {}
    async with Engine(**ENGINE_KW) as engine:
        async def run(name, prompt, params):
            results[name] = await collect(engine, prompt, params)

        async with anyio.create_task_group() as group:
            for i in range(0, 6):
                group.start_soon(run, i, PROMPTS[i], PARAMS[i])
            group.start_soon(run, "step", [1, 2, poison, 4], SamplingParams(max_tokens=5))
            group.start_soon(run, "detok", [1, 2, 3, 31338], SamplingParams(max_tokens=5))
        assert results["step"][2][-1] == "error"
        assert results["detok"][2][-1] == "error"
        for i in range(0, 6):
            assert results[i][0] == expected[i].token_ids
        ok = await engine.generate("Still alive?", SamplingParams(temperature=0, max_tokens=4))
        assert len(ok.token_ids) == 4
        assert engine.stats()["running"] == 0


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
@pytest.mark.anyio
async def test_bad_prompt_raises_and_engine_continues():
    async with Engine(**ENGINE_KW) as engine:
        with pytest.raises(ValueError, match="empty"):
            await engine.generate("")
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.generate(list(range(100, 2200)))
        async with anyio.create_task_group() as group:
            group.start_soon(collect, engine, "a long story", SamplingParams(max_tokens=30), "dup")
            await anyio.sleep(0.01)
            with pytest.raises(ValueError, match="already in use"):
                await collect(engine, "again", SamplingParams(max_tokens=3), "dup")
            group.cancel_scope.cancel()
        await engine.abort("no-such-request")
        out = await engine.generate("Hi", SamplingParams(temperature=0, max_tokens=3))
        assert len(out.token_ids) == 3
    with pytest.raises(RuntimeError, match="not running"):
        await engine.generate("after close")


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
@pytest.mark.anyio
async def test_graph_is_printable_and_names_every_stage():
    async with Engine(**ENGINE_KW) as engine:
        text = engine.graph
    for name in ("tokenize", "admit", "schedule", "forward", "offload", "emit"):
        assert name in text


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
@pytest.mark.anyio
async def test_a_crashing_stage_stops_the_engine_cleanly(monkeypatch):
    from astream.core.engine_core import EngineCore
    from astream.engine.engine import EngineClosedError

    def broken_process(self, output):
        raise RuntimeError("bug in output processing")

    async with Engine(**ENGINE_KW) as engine:
        monkeypatch.setattr(EngineCore, "process", broken_process)
        ids, text, reasons = await collect(engine, "Hello", SamplingParams(max_tokens=4))
        assert reasons[-1] == "error"
        assert not engine.running
        assert "bug in output processing" in engine.stats()["fault"]
        with pytest.raises(EngineClosedError):
            await engine.generate("again")


def test_list_sink_numbers_tokens_in_order_around_progress():
    from astream.core.request import ListSink

    sink, request = ListSink(), None                      # a list sink reads nothing of its request
    sink.token(request, 5, "a", None)
    sink.progress(request, 10, 20)
    sink.token(request, 6, "b", None)
    sink.token(request, 7, "", "length")
    assert [(t.index, t.token_id) for t in sink.tokens] == [(0, 5), (1, 6), (2, 7)]
    assert sink.next_index == 3


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
@pytest.mark.anyio
async def test_a_long_prompt_streams_prefill_progress_before_its_first_token():
    from astream.base.outputs import Progress
    chunk = 64
    async with Engine(**{**ENGINE_KW, "max_num_batched_tokens": chunk}) as engine:
        items, steps_at = [], []
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        async for item in engine.stream("the cat sat on the mat. " * 100, params, progress=True):
            items.append(item)
            steps_at.append(engine.stats()["steps"])
    first = next(i for i, item in enumerate(items) if not isinstance(item, Progress))
    progress, tokens = items[:first], items[first:]
    total = progress[0].total
    # One update at admission (0), then one a chunk but the last (the one that samples).
    assert total > 8 * chunk and len(progress) == -(-total // chunk)
    assert [p.prefilled for p in progress] == list(range(0, total, chunk))
    assert all(p.total == total for p in progress)
    assert not any(isinstance(item, Progress) for item in tokens) and len(tokens) == 3
    # Each update reaches the consumer while the prefill goes on: the first chunk's long
    # before half the chunks ran, not all of them at the end.
    assert steps_at[1] < len(progress) // 2 and steps_at == sorted(steps_at)
