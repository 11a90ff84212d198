"""One client must never stop the server, break a connection or hurt the others.

Each test is a reproduction of an attack or a heavy user's mistake, against a real
server on a loopback port: the server stays up (/health), other streams go on
unchanged, and every KV block comes back.
"""

from __future__ import annotations

import json
import logging

import anyio
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from astream import SamplingParams
from astream.core.engine_core import EngineCore
from server_helpers import GREEDY, LONG, PROMPTS, Wire, check_against, generate, health, \
    health_status, serving, wait_idle


@pytest.fixture(scope="module")
def expected(smol_llm):
    return [smol_llm.generate([p], SamplingParams(**GREEDY))[0] for p in PROMPTS]


def raw_frame(frame: dict) -> str:
    """JSON with every non-ASCII character escaped, so lone surrogates travel as '\\ud800'."""
    return json.dumps(frame, ensure_ascii=True)


@pytest.mark.anyio
async def test_huge_top_k_is_refused_and_the_largest_valid_one_serves(server, expected, idle_free):
    async with connect(server.url) as ws:
        wire = Wire(ws)
        await wire.send(generate("a", PROMPTS[0], temperature=1, top_k=5, max_tokens=8))
        await wire.send(generate("b", "y", temperature=1, top_k=18446744073709551616))
        error = await wire.error()
        assert (error["id"], error["code"]) == ("b", "invalid_field") and "top_k" in error["message"]
        assert (await wire.until_end("a"))[-1]["type"] == "done"
        await wire.send(generate("c", PROMPTS[0], temperature=1, top_k=2**63 - 1, max_tokens=8))
        assert (await wire.until_end("c"))[-1]["type"] == "done"
        await wire.send(generate("d", PROMPTS[0], **GREEDY))
        check_against(await wire.until_end("d"), expected[0])
    assert (await health(server.port))["status"] == "ok"
    await wait_idle(server.port, idle_free)


@pytest.mark.anyio
async def test_lone_surrogates_get_error_frames_and_the_connection_lives(server, expected, idle_free):
    async with connect(server.url) as ws:
        wire = Wire(ws)
        await wire.send(generate("live", PROMPTS[0], **GREEDY))
        cases = [({"type": "cancel", "id": "\ud800"}, "invalid_field", None),
                 ({"type": "generate", "id": "x\udfff", "prompt": "hi"}, "invalid_field", None),
                 (generate("p", "hi \ud800 there"), "invalid_prompt", "p"),
                 ({"type": "generate", "id": "m",
                   "messages": [{"role": "user", "content": "\udc00"}]}, "invalid_prompt", "m"),
                 (generate("s", "hi", stop=["\ud83d"]), "invalid_field", "s"),
                 ({"type": "summon\ud800", "id": "t"}, "unknown_type", "t")]
        for frame, code, request_id in cases:
            await wire.send(raw_frame(frame))
            error = await wire.error()
            assert (error["code"], error["id"]) == (code, request_id), (frame, error)
        check_against(await wire.until_end("live"), expected[0])
    await wait_idle(server.port, idle_free)


@pytest.mark.anyio
async def test_stop_string_limits(server, expected, idle_free):
    async with connect(server.url) as ws:
        wire = Wire(ws)
        await wire.send(generate("many", "hi", stop=[f"z{i}" for i in range(65)]))
        assert (await wire.error())["code"] == "invalid_field"
        await wire.send(generate("long", "hi", stop=["z" * 257]))
        assert (await wire.error())["code"] == "invalid_field"
        await wire.send(generate("ids", "hi", stop_token_ids=list(range(100_000, 100_257))))
        assert (await wire.error())["code"] == "invalid_field"
        # The most a request may ask for changes nothing when none of them occurs.
        most = [f"{i:03d}" + "~" * 253 for i in range(64)]
        await wire.send(generate("most", PROMPTS[0], stop=most, **GREEDY))
        check_against(await wire.until_end("most"), expected[0])
    await wait_idle(server.port, idle_free)


@pytest.mark.anyio
async def test_json_depth_and_non_finite_numbers(server, idle_free, caplog):
    caplog.set_level(logging.ERROR, logger="astream")
    async with connect(server.url) as ws:
        wire = Wire(ws)
        await wire.send("[" * 30_000 + "]" * 30_000)
        assert (await wire.error())["code"] == "invalid_json"
        await wire.send(generate("deep", "hi", stop=[[[[[[[[["x"]]]]]]]]]))    # 12 levels
        assert (await wire.error())["code"] == "invalid_json"
        for constant in ("Infinity", "-Infinity", "NaN"):
            await wire.send('{"type":"generate","id":"n","prompt":"hi","params":{"temperature":%s}}'
                            % constant)
            assert (await wire.error())["code"] == "invalid_json"
        await wire.send('{"type":"generate","id":"big","prompt":"hi","params":{"temperature":1e999}}')
        error = await wire.error()
        assert (error["code"], error["id"]) == ("invalid_field", "big")
    assert not caplog.records                              # no traceback per frame
    await wait_idle(server.port, idle_free)


@pytest.mark.anyio
async def test_handshake_guards(server):
    async with serving(api_key="s3cret") as keyed:
        doubled = [("Authorization", "Bearer s3cret"), ("Authorization", "Bearer s3cret")]
        with pytest.raises(InvalidStatus) as refused:
            await connect(keyed.url, additional_headers=doubled)
        assert refused.value.response.status_code == 400
        # With a key, the key is the guard: a browser page holding it may connect.
        async with connect(keyed.url, origin="http://app.example",
                           additional_headers={"Authorization": "Bearer s3cret"}) as ws:
            await ws.ping()
    # Without a key, a browser page must be allowed by name.
    with pytest.raises(InvalidStatus) as refused:
        await connect(server.url, origin="http://evil.example")
    assert refused.value.response.status_code == 403
    async with serving(allowed_origins=("http://app.example",)) as open_server:
        async with connect(open_server.url, origin="http://app.example") as ws:
            await ws.ping()
        with pytest.raises(InvalidStatus):
            await connect(open_server.url, origin="http://evil.example")
    async with connect(server.url) as ws:                # no Origin: not a browser
        await ws.ping()


@pytest.mark.anyio
async def test_connection_cap_and_default_request_limit():
    async with serving({"max_num_seqs": 8}, max_connections=2,
                       max_requests_per_connection=None) as srv:
        async with connect(srv.url) as first, connect(srv.url) as second:
            with pytest.raises(InvalidStatus) as refused:
                await connect(srv.url)
            assert refused.value.response.status_code == 503
            wire = Wire(first)
            for i in range(2):                             # a quarter of max_num_seqs = 2
                await wire.send(generate(f"r{i}", "Tell me a long story.", **LONG))
            await wire.send(generate("r2", "hi", max_tokens=4))
            assert (await wire.error())["code"] == "too_many_requests"
            await second.ping()
        async with connect(srv.url) as third:              # slots free again
            await third.ping()


@pytest.mark.anyio
async def test_prompts_too_large_to_fit_are_refused_before_tokenization(monkeypatch):
    tokenized = []
    original = EngineCore.tokenize

    def counting_tokenize(self, prompt):
        tokenized.append(len(prompt))
        return original(self, prompt)

    monkeypatch.setattr(EngineCore, "tokenize", counting_tokenize)
    async with serving({"max_model_len": 256}, max_frame_bytes=2**20) as srv:
        async with connect(srv.url) as ws:
            wire = Wire(ws)
            for i in range(8):
                await wire.send(generate(f"big{i}", "word " * 180_000))
            for i in range(8):
                error = await wire.error()
                assert error["code"] == "prompt_too_long"
            await wire.send(generate("ok", "Hi", temperature=0, max_tokens=2))
            assert (await wire.until_end("ok"))[-1]["type"] == "done"
    assert tokenized == [2]


@pytest.mark.anyio
async def test_engine_fault_leaves_the_server_answering(monkeypatch):
    async with serving() as srv:
        def broken_process(self, output):
            raise RuntimeError("bug in output processing")

        monkeypatch.setattr(EngineCore, "process", broken_process)
        async with connect(srv.url) as ws:
            wire = Wire(ws)
            await wire.send(generate("r", "Hello", max_tokens=4))
            frames = await wire.until_end("r")
            assert frames[-1]["type"] == "error" and frames[-1]["code"] == "engine_error"
            status, body = await health_status(srv.port)
            assert (status, body["status"]) == (503, "engine_stopped")
            await wire.send(generate("again", "Hello", max_tokens=4))
            error = await wire.error()
            assert (error["id"], error["code"]) == ("again", "engine_error")
        async with connect(srv.url) as ws:                 # still accepting connections
            await ws.ping()
        await anyio.sleep(0.05)                            # the test's own code is not cancelled
