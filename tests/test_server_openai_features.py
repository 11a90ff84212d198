"""What clients send beyond the basics, through the server: n completions, logprobs,
penalties, min_tokens, unknown fields, and prompts that do not fit the context, on both
protocols where they apply."""

from __future__ import annotations

import json
import logging
import math

import anyio
import pytest
from websockets.asyncio.client import connect

from astream import LLM, SamplingParams
from server_helpers import ENGINE_KW, Wire, generate, http_exchange, serving, wait_idle

openai = pytest.importorskip("openai", reason="the test extra installs the openai client")

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", [("asyncio", {})])]

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Name three colours."}]


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)


async def in_thread(fn):
    return await anyio.to_thread.run_sync(fn)


async def post(port: int, path: str, payload: dict) -> tuple[int, dict | str]:
    body = json.dumps(payload).encode()
    status, _, text = await http_exchange(port, f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: "
                                          f"close\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    return status, text


@pytest.fixture(scope="module")
def expected():
    with LLM(**ENGINE_KW) as llm:
        greedy = llm.generate([CHAT], SamplingParams(temperature=0, max_tokens=8, logprobs=3))[0]
        penalized = llm.generate(["1, 2, 3, 4,"], SamplingParams(
            temperature=0, max_tokens=8, frequency_penalty=1.5, repetition_penalty=1.3,
            min_tokens=8))[0]
    return {"greedy": greedy, "penalized": penalized}


async def test_n_completions_whole_and_streamed(expected):
    async with serving() as srv:
        api = client(srv.port)
        whole = await in_thread(lambda: api.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=8, temperature=0, n=3))
        assert [c.index for c in whole.choices] == [0, 1, 2]
        assert {c.message.content for c in whole.choices} == {expected["greedy"].text}
        assert whole.usage.completion_tokens == 3 * len(expected["greedy"].token_ids)

        def streamed():
            return list(api.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6,
                                               temperature=1.0, seed=7, n=2, stream=True))

        texts = {0: "", 1: ""}
        finished = set()
        for chunk in await in_thread(streamed):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                if choice.finish_reason is not None:
                    finished.add(choice.index)
        assert finished == {0, 1} and all(texts.values())
        await wait_idle(srv.port, srv.engine.stats()["kv_blocks_total"])


async def test_logprobs_whole_and_streamed_match_the_engine(expected):
    want = expected["greedy"]
    async with serving() as srv:
        api = client(srv.port)
        whole = await in_thread(lambda: api.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3))
        content = whole.choices[0].logprobs.content
        assert [c.logprob for c in content] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
        assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token for c in content)
        assert "".join(c.token for c in content) == want.text

        def streamed():
            return list(api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8,
                                                    temperature=0, logprobs=True, stream=True))

        chunks = await in_thread(streamed)
        streamed_lps = [c.logprob for chunk in chunks for choice in chunk.choices
                        if choice.logprobs for c in choice.logprobs.content]
        assert streamed_lps == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)

        completion = await in_thread(lambda: api.completions.create(
            model=MODEL, prompt=want.prompt_token_ids, max_tokens=8, temperature=0, logprobs=2))
        lps = completion.choices[0].logprobs
        assert len(lps.tokens) == len(want.token_ids) and all(len(t) <= 2 for t in lps.top_logprobs)
        assert all(v <= 0 and math.isfinite(v) for v in lps.token_logprobs)
        assert lps.text_offset[0] == 0


async def test_penalties_and_min_tokens_reach_the_sampler(expected):
    want = expected["penalized"]
    async with serving() as srv:
        status, text = await post(srv.port, "/v1/completions", {
            "model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 8, "temperature": 0,
            "frequency_penalty": 1.5, "repetition_penalty": 1.3, "min_tokens": 8})
        assert status == 200, text
        body = json.loads(text)
        assert body["choices"][0]["text"] == want.text
        assert body["usage"]["completion_tokens"] == 8
        status, text = await post(srv.port, "/v1/completions", {
            "model": MODEL, "prompt": "x", "presence_penalty": 3})
        assert status == 400 and json.loads(text)["error"]["param"] == "presence_penalty"


async def test_unknown_fields_are_accepted_and_logged(caplog):
    caplog.set_level(logging.WARNING, logger="astream.server")
    async with serving() as srv:
        status, text = await post(srv.port, "/v1/chat/completions", {
            "model": MODEL, "messages": CHAT, "max_tokens": 2, "store": True,
            "metadata": {"k": "v"}, "service_tier": "auto"})
        assert status == 200, text
    assert any("metadata, service_tier, store" in r.getMessage() for r in caplog.records)


async def test_prompts_that_do_not_fit_are_refused_on_both_protocols():
    async with serving({"max_model_len": 256}, max_tokens_cap=64) as srv:
        long_prompt = [42] * 300                        # over max_model_len alone
        fits_alone = [42] * 220                         # fits, but not with 64 new tokens
        for prompt, max_tokens in ((long_prompt, 4), (fits_alone, 64)):
            for stream in (False, True):
                status, text = await post(srv.port, "/v1/completions", {
                    "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream})
                assert status == 400, text
                error = json.loads(text)["error"]
                assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
        status, text = await post(srv.port, "/v1/completions", {
            "model": MODEL, "prompt": fits_alone, "max_tokens": 36})       # 256 exactly: fits
        assert status == 200, text
        async with connect(srv.url) as ws:
            wire = Wire(ws)
            for i, (prompt, max_tokens) in enumerate(((long_prompt, 4), (fits_alone, 64))):
                await wire.send({"type": "generate", "id": f"r{i}", "prompt": prompt,
                                 "params": {"max_tokens": max_tokens}})
                error = await wire.error()
                assert (error["id"], error["code"]) == (f"r{i}", "prompt_too_long")
            await wire.send(generate("n", "hi", n=2))
            assert (await wire.error())["code"] == "invalid_field"
        await wait_idle(srv.port, srv.engine.stats()["kv_blocks_total"])


async def test_logprobs_on_the_websocket():
    async with serving() as srv:
        async with connect(srv.url) as ws:
            wire = Wire(ws)
            await wire.send(generate("l", "Hello", temperature=0, max_tokens=3, logprobs=2))
            frames = await wire.until_end("l")
        tokens = [f for f in frames if f["type"] == "token"]
        assert tokens and all(f["logprob"] <= 0 and len(f["top_logprobs"]) == 2 for f in tokens)
        assert all(f["top_logprobs"][0][0] == f["token_id"] for f in tokens)


async def test_a_defaulted_max_tokens_is_not_refused_for_a_short_context():
    """Clients that leave max_tokens out get the server's cap as a bound, not a promise: the
    answer ends with "length" at max_model_len rather than a 400."""
    async with serving({"max_model_len": 256}, max_tokens_cap=1024) as srv:
        status, text = await post(srv.port, "/v1/chat/completions", {
            "model": MODEL, "messages": CHAT, "temperature": 0})
        assert status == 200, text
        async with connect(srv.url) as ws:
            wire = Wire(ws)
            await wire.send({"type": "generate", "id": "d", "prompt": [42] * 200,
                             "params": {"temperature": 0, "ignore_eos": True}})
            done = (await wire.until_end("d"))[-1]
        assert done["type"] == "done" and done["finish_reason"] == "length"
        assert done["usage"]["prompt_tokens"] + done["usage"]["completion_tokens"] <= 256


async def test_streamed_completion_text_offsets_run_on_across_chunks():
    async with serving() as srv:
        def streamed():
            return list(client(srv.port).completions.create(
                model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                logprobs=1, stream=True))

        chunks = await in_thread(streamed)
    seen = [(lp.text_offset, lp.tokens) for chunk in chunks for choice in chunk.choices
            if (lp := choice.logprobs) is not None and lp.tokens]
    offsets = [offset for offsets, _ in seen for offset in offsets]
    lengths = [len(token) for _, tokens in seen for token in tokens]
    assert offsets == [sum(lengths[:i]) for i in range(len(lengths))] and len(offsets) > 1


async def test_a_failure_before_the_response_is_a_json_500_and_the_server_goes_on(monkeypatch):
    async def broken(*args, **kwargs):
        raise RuntimeError("boom")

    async with serving() as server:
        with monkeypatch.context() as patch:
            patch.setattr(server.engine, "request", broken)
            status, text = await post(server.port, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 500, text
        assert json.loads(text)["error"] == {"message": "internal error: RuntimeError",
                                             "type": "server_error", "param": None, "code": "internal"}
        status, text = await post(server.port, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 2, text


async def test_a_client_that_left_is_no_error_even_from_a_task_group():
    from uvicorn.protocols.utils import ClientDisconnected

    from astream.server.http import client_left

    assert client_left(ClientDisconnected())
    assert client_left(BaseExceptionGroup("", [ClientDisconnected(), BrokenPipeError()]))
    assert not client_left(BaseExceptionGroup("", [ClientDisconnected(), RuntimeError("bug")]))
    assert not client_left(RuntimeError("bug"))
