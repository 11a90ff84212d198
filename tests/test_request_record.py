"""One record per request: every surface reports the record's finish reason and token
count, and a request that ends early (abort, a consumer that leaves, cancellation, a
consumer that stalls) leaves no entry anywhere once the engine has drained."""

from __future__ import annotations

import anyio
import pytest

from astream import Engine, SamplingParams
from server_helpers import ENGINE_KW, serving

openai = pytest.importorskip("openai", reason="the test extra installs the openai client")

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", [("asyncio", {})])]

PROMPT = "The capital of France is"


async def followed(engine: Engine, params: SamplingParams, request_id: str):
    """Stream a request to its end, holding its record (read while it was live)."""
    stream = await engine.request(PROMPT, params, request_id)
    record = engine.core.requests[request_id]
    async with stream:
        tokens = [tok async for tok in stream]
    assert request_id not in engine.core.requests
    return record, stream, tokens


async def test_finish_reason_and_token_count_are_the_records_on_every_surface(smol_llm):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    offline = smol_llm.generate(PROMPT, greedy)[0]
    stop = offline.text[len(offline.text) // 2:][:4]            # ends it halfway, by a string
    cases = {"length": SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
             "stop": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
             "two": SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=4, ignore_eos=True)}
    reasons = {"length": "length", "stop": "stop", "two": "length"}
    async with serving() as srv:
        engine = srv.engine
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="none",
                            max_retries=0)
        for name, params in cases.items():
            record, stream, tokens = await followed(engine, params, f"r-{name}")
            finals = {tok.choice: tok for tok in tokens if tok.finish_reason is not None}
            assert sorted(finals) == list(range(params.n))
            for choice in record.choices:                        # the record: one place each
                assert finals[choice.seq.index].finish_reason == choice.finish_reason
                assert [t.token_id for t in tokens if t.choice == choice.seq.index] == \
                    choice.seq.output_token_ids
            assert stream.finish_reason == record.finish_reason == tokens[-1].finish_reason \
                == reasons[name]
            assert stream.completion_tokens == record.completion_tokens == len(tokens)
            assert stream.prompt_tokens == len(record.prompt_token_ids)

            outputs = smol_llm.generate(PROMPT, params)[0].outputs
            assert [(o.finish_reason, len(o.token_ids)) for o in outputs] == \
                [(c.finish_reason, c.num_tokens) for c in record.choices]

            whole = await anyio.to_thread.run_sync(lambda: api.completions.create(
                model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=params.max_tokens,
                temperature=params.temperature, seed=params.seed, n=params.n,
                stop=list(params.stop) or None, extra_body={"ignore_eos": True}))
            assert [c.finish_reason for c in sorted(whole.choices, key=lambda c: c.index)] == \
                [c.finish_reason for c in record.choices]
            assert whole.usage.completion_tokens == record.completion_tokens


def assert_nothing_left(engine: Engine) -> None:
    core = engine.core
    sched, blocks = core.scheduler, core.scheduler.blocks
    assert core.requests == {}
    assert not (sched.running or sched.parked or sched.isolated or sched.waiting)
    assert sched.waiting.queues == {} and sched.waiting.lines == {}
    assert sorted(sched.free_slots) == list(range(sched.config.max_num_seqs))
    assert blocks.num_free == blocks.num_blocks
    assert all(block.ref_count == 0 for block in blocks.blocks)
    stats = engine.stats()
    assert (stats["requests"], stats["running"], stats["waiting"], stats["paused"]) == (0, 0, 0, 0)


async def test_requests_ended_early_leave_no_entry_anywhere():
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    async with Engine(stream_buffer_tokens=4, **ENGINE_KW) as engine:
        left = await engine.request(PROMPT, long, "left")          # its consumer leaves
        aborted = await engine.request(PROMPT, SamplingParams(temperature=0, max_tokens=200,
                                                              ignore_eos=True, n=2), "aborted")
        stalled = await engine.request(PROMPT, long, "stalled")    # read once, then never
        unread = await engine.request(PROMPT, long, "unread")      # closed before any read
        cancelled_tokens = []

        async def cancelled() -> None:
            with anyio.CancelScope() as scope:
                async for tok in engine.stream(PROMPT, long, "cancelled"):
                    cancelled_tokens.append(tok)
                    if len(cancelled_tokens) == 2:
                        scope.cancel()                      # its next wait raises

        async with anyio.create_task_group() as group:
            group.start_soon(cancelled)
            taken = [await left.__anext__() for _ in range(3)]
            await left.aclose()
            assert left.finish_reason == "abort" and left.completion_tokens >= len(taken)
            await aborted.__anext__()
            await engine.abort("aborted")
            ends = [tok async for tok in aborted if tok.finish_reason is not None]
            assert sorted(tok.choice for tok in ends) == [0, 1]
            assert {tok.finish_reason for tok in ends} == {"abort"}
            await stalled.__anext__()
            while not engine.core.requests["stalled"].paused:
                await anyio.sleep(0.01)
            await stalled.aclose()
            await unread.aclose()
        assert len(cancelled_tokens) == 2 and "cancelled" not in engine.core.requests
        for stream in (left, aborted, stalled, unread):
            assert stream.finish_reason == "abort"
        assert_nothing_left(engine)
