"""The engine in a process of its own (EngineProcess) behind the server: the same tokens,
errors, cancellation, backpressure and shutdown as an in-process Engine, and a child that
dies ends its requests with an error instead of hanging them."""

from __future__ import annotations

import json
import os
import signal

import anyio
import pytest

from astream import Engine, SamplingParams
from astream.base.errors import EngineClosedError, PromptTooLongError
from astream.face.client import Client
from astream.server import ServerOptions, StreamServer
from astream.server.engine_process import EngineProcess
from server_helpers import ENGINE_KW, GREEDY, OPTIONS, health, health_status, http_exchange

pytestmark = pytest.mark.anyio
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
async def proc_server():
    async with EngineProcess(**ENGINE_KW, stream_buffer_tokens=8) as engine:
        async with StreamServer(engine, ServerOptions(**OPTIONS)) as srv:
            yield srv


async def _post(port: int, path: str, body: dict) -> tuple[int, str]:
    data = json.dumps(body).encode()
    status, _, text = await http_exchange(port, (
        f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data)
    return status, text


async def _idle(port: int, timeout: float = 20) -> dict:
    """/health once no request is live and every KV block is back (stats lag up to 0.25 s)."""
    with anyio.fail_after(timeout):
        while True:
            stats = await health(port)
            if stats["live_requests"] == 0 and stats["requests"] == 0 \
                    and stats["kv_blocks_free"] == stats["kv_blocks_total"]:
                return stats
            await anyio.sleep(0.05)


async def test_same_greedy_text_as_the_engine_in_process(proc_server):
    async with Engine(**ENGINE_KW) as engine:
        expected = (await engine.generate(PROMPT, SamplingParams(**GREEDY))).text
    async with Client(proc_server.url) as client:
        got = "".join([tok.text async for tok in client.stream(PROMPT, **GREEDY)])
    assert got == expected and got
    engine = proc_server.engine
    direct = [tok async for tok in engine.stream(PROMPT, SamplingParams(**GREEDY))]
    assert "".join(tok.text for tok in direct) == expected and direct[-1].finish_reason == "length"
    assert engine._tokenizer is None          # the parent loads it for the first logprobs only
    status, text = await _post(proc_server.port, "/v1/completions",
                               {"prompt": PROMPT, "temperature": 0, "max_tokens": 12, "n": 2,
                                "logprobs": 2})
    body = json.loads(text)
    assert status == 200, text
    assert [c["text"] for c in body["choices"]] == [expected, expected]
    assert body["usage"]["completion_tokens"] == 24
    tokens = body["choices"][0]["logprobs"]["tokens"]       # named by the parent's tokenizer
    assert "".join(tokens) == expected
    assert engine._tokenizer is not None


async def test_context_checks_answer_400(proc_server):
    status, text = await _post(proc_server.port, "/v1/completions",
                               {"prompt": "word " * 3000, "max_tokens": 4})
    assert status == 400 and json.loads(text)["error"]["code"] == "context_length_exceeded", text
    status, text = await _post(proc_server.port, "/v1/completions",
                               {"prompt": "word " * 2000, "max_tokens": 60})
    assert status == 400 and json.loads(text)["error"]["code"] == "context_length_exceeded", text
    engine = proc_server.engine
    with pytest.raises(PromptTooLongError):             # found by tokenizing: at the first item
        async with await engine.request("word " * 3000, SamplingParams(max_tokens=4)) as stream:
            await stream.__anext__()
    stream = await engine.request(PROMPT, SamplingParams(max_tokens=4), "dup")
    with pytest.raises(ValueError, match="still live"):
        await engine.request(PROMPT, SamplingParams(max_tokens=4), "dup")
    await stream.aclose()


async def test_a_reader_that_stops_pauses_its_sequence_then_resumes(proc_server):
    engine = proc_server.engine
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    async with await engine.request(PROMPT, params) as stream:
        first = await stream.__anext__()
        with anyio.fail_after(20):
            while engine.stats()["paused"] != 1:      # credit (8) and the channel's buffer (8) full
                await anyio.sleep(0.05)
        await anyio.sleep(0.5)
        assert engine.stats()["paused"] == 1
        items = [first] + [item async for item in stream]
    assert len(items) == 60 and items[-1].finish_reason == "length"
    await _idle(proc_server.port)


async def test_a_dropped_stream_frees_its_kv(proc_server):
    engine = proc_server.engine
    stream = await engine.request(PROMPT, SamplingParams(max_tokens=60, ignore_eos=True))
    await stream.__anext__()
    await stream.aclose()
    stats = await _idle(proc_server.port)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    async with Client(proc_server.url) as client:            # and the engine serves on
        assert "".join([t.text async for t in client.stream(PROMPT, **GREEDY)])


async def test_bad_options_fail_before_a_process_starts_and_a_bad_model_after():
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineProcess(**ENGINE_KW, max_num_seqs=0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        async with EngineProcess("/nonexistent/model.gguf", **ENGINE_KW):
            pass


async def test_a_dead_engine_process_ends_live_requests_with_an_error():
    async with EngineProcess(**ENGINE_KW) as engine:
        async with StreamServer(engine, ServerOptions(**OPTIONS)) as srv:
            stream = await engine.request(PROMPT, SamplingParams(max_tokens=60, ignore_eos=True))
            await stream.__anext__()
            child = engine._process
            os.kill(child.pid, signal.SIGKILL)
            with anyio.fail_after(20):
                items = [item async for item in stream]
            assert items[-1].finish_reason == "error" and "exited" in items[-1].error
            with pytest.raises(EngineClosedError):
                await engine.request(PROMPT)
            status, body = await health_status(srv.port)
            assert status == 503 and body["status"] == "engine_stopped"
    assert not child.is_alive()
