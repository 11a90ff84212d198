"""Streams over the websocket server match offline generation: many requests, many connections, progress."""

from __future__ import annotations

from contextlib import aclosing

import anyio
import pytest
from websockets.asyncio.client import connect

from astream import SamplingParams
from astream.face.client import Client, ServerError
from server_helpers import GREEDY, LONG, PROMPTS, Wire, check_against, generate, wait_idle


@pytest.fixture(scope="module")
def expected(smol_llm):
    return [smol_llm.generate([p], SamplingParams(**GREEDY))[0] for p in PROMPTS]


@pytest.mark.anyio
async def test_streams_match_offline_generation(server, expected):
    async with connect(server.url) as ws:
        wire = Wire(ws)
        for i, prompt in enumerate(PROMPTS):
            await wire.send(generate(f"r{i}", prompt, **GREEDY))
        for i in range(len(PROMPTS)):
            check_against(await wire.until_end(f"r{i}"), expected[i])


@pytest.mark.anyio
async def test_32_connections_with_2_requests_each(server, expected, idle_free):
    results = {}

    async def one_connection(c: int) -> None:
        async with connect(server.url) as ws:
            wire = Wire(ws)
            for i, prompt in enumerate(PROMPTS):
                await wire.send(generate(f"c{c}-{i}", prompt, **GREEDY))
            for i in range(len(PROMPTS)):
                results[c, i] = await wire.until_end(f"c{c}-{i}")

    with anyio.fail_after(120):
        async with anyio.create_task_group() as group:
            for c in range(32):
                group.start_soon(one_connection, c)
    assert len(results) == 64
    for (c, i), frames in results.items():
        check_against(frames, expected[i])
    await wait_idle(server.port, idle_free)


@pytest.mark.anyio
async def test_client_multiplexes_and_cancels_on_break(server, expected, idle_free):
    results = {}
    async with Client(server.url) as client:
        async def collect(i: int) -> None:
            results[i] = [tok.token_id async for tok in client.stream(PROMPTS[i], **GREEDY)]

        async def leave_early() -> None:
            async with aclosing(client.stream("Tell me a long story.", **LONG)) as tokens:
                async for tok in tokens:
                    if tok.index == 2:
                        break

        async with anyio.create_task_group() as group:
            for i in range(len(PROMPTS)):
                group.start_soon(collect, i)
            group.start_soon(leave_early)
        text, done = await client.generate(PROMPTS[0], **GREEDY)
        with pytest.raises(ServerError) as err:
            await client.generate("hi", max_tokens=4, bogus=1)
        async for tok in client.stream("Tell me a long story.", **LONG):
            break                                     # a plain break cancels too (on finalization)
        await wait_idle(server.port, idle_free)
    for i in range(len(PROMPTS)):
        assert results[i] == expected[i].token_ids
    assert (text, done["usage"]["completion_tokens"]) == (expected[0].text, len(expected[0].token_ids))
    assert err.value.code == "unknown_param"


@pytest.mark.anyio
async def test_progress_frames_during_a_long_prefill(server):
    prompt = "The history of the sea is long. " * 80           # about 640 tokens, one slow chunk
    async with connect(server.url) as ws:
        wire = Wire(ws)
        await wire.send(generate("p", prompt, temperature=0, max_tokens=2))
        frames = await wire.until_end("p")
    kinds = [f["type"] for f in frames]
    total = frames[-1]["usage"]["prompt_tokens"]
    assert total > 500 and kinds[0] == "progress" and kinds[-1] == "done"
    assert kinds.index("token") > kinds.index("progress")
    assert "progress" not in kinds[kinds.index("token"):]
    assert all(f["total"] == total and 0 <= f["prefilled"] <= total
               for f in frames if f["type"] == "progress")
