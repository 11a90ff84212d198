"""The OpenAI HTTP API on the websocket port, driven by the official `openai` client (and raw
HTTP where a client would hide the wire): text and usage equal LLM.generate's, streamed and
whole; a client that leaves mid-stream frees its KV; errors have OpenAI's shape and status."""

from __future__ import annotations

import json

import anyio
import pytest

from astream import LLM, SamplingParams
from server_helpers import ENGINE_KW, http_exchange, serving, wait_idle

openai = pytest.importorskip("openai", reason="the test extra installs the openai client")

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", [("asyncio", {})])]

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def expected():
    with LLM(**ENGINE_KW) as llm:
        chat, text = llm.generate([CHAT, "The capital of France is"],
                                  SamplingParams(temperature=0, max_tokens=12))
    return {"chat": chat, "text": text}


def client(port: int, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)


async def in_thread(fn, *args):
    return await anyio.to_thread.run_sync(fn, *args)


async def raw_request(port: int, method: str, path: str, body: bytes = b"", headers: str = "",
                      length: int | None = None) -> tuple[int, str, str]:
    """One HTTP request on a fresh connection: (status, head, body)."""
    length = len(body) if length is None else length
    return await http_exchange(port, f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: "
                               f"{length}\r\nConnection: close\r\n{headers}\r\n".encode() + body)


async def test_chat_and_completions_match_generate_whole_and_streamed(expected):
    async with serving() as srv:
        api = client(srv.port)
        models = await in_thread(lambda: api.models.list())
        assert [m.id for m in models.data] == [MODEL]
        whole = await in_thread(lambda: api.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=12, temperature=0))
        want = expected["chat"]
        assert whole.choices[0].message.content == want.text
        assert whole.choices[0].finish_reason == want.finish_reason
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == \
            (len(want.prompt_token_ids), len(want.token_ids))

        def streamed_chat():
            chunks = list(api.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stream=True,
                stream_options={"include_usage": True}))
            return chunks

        chunks = await in_thread(streamed_chat)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == want.text
        assert chunks[-2].choices[0].finish_reason == want.finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)

        want = expected["text"]
        done = await in_thread(lambda: api.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0))
        assert done.choices[0].text == want.text and done.usage.completion_tokens == len(want.token_ids)
        pieces = await in_thread(lambda: list(api.completions.create(
            model=MODEL, prompt=want.prompt_token_ids, max_tokens=12, temperature=0, stream=True)))
        assert "".join(p.choices[0].text for p in pieces) == want.text
        assert pieces[-1].choices[0].finish_reason == want.finish_reason
        await wait_idle(srv.port, srv.engine.stats()["kv_blocks_total"])


async def test_a_client_that_leaves_mid_stream_frees_every_block():
    async with serving() as srv:
        total = srv.engine.stats()["kv_blocks_total"]
        body = json.dumps({"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 64,
                           "ignore_eos": True, "stream": True}).encode()
        async with await anyio.connect_tcp("127.0.0.1", srv.port) as sock:
            await sock.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                            % len(body) + body)
            seen = b""
            while b"data: {" not in seen:            # the first token's chunk arrived
                seen += await sock.receive()
        stats = await wait_idle(srv.port, total)
        assert stats["steps"] < 60                    # aborted, not run to its 64 tokens


async def test_errors_have_openais_shape_and_status():
    async with serving() as srv:
        port = srv.port
        cases = [
            ("POST", "/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
            ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
            ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"5": 1}}, 400,
             "logit_bias"),
            ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**6}, 400,
             "max_tokens"),
            ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400,
             "temperature"),
            ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [], "stream": True}, 400,
             "messages"),
            ("POST", "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "logprobs": True,
                                              "top_logprobs": 21}, 400, "top_logprobs"),
            ("GET", "/v1/completions", None, 405, None),
            ("POST", "/v1/embeddings", {"input": "x"}, 404, None),
        ]
        for method, path, payload, status, param in cases:
            body = b"" if payload is None else json.dumps(payload).encode()
            got, head, text = await raw_request(port, method, path, body)
            error = json.loads(text)["error"]
            assert (got, error["param"]) == (status, param), (path, payload, text)
            assert error["message"] and "application/json" in head
        got, _, text = await raw_request(port, "POST", "/v1/completions", b"{not json")
        assert got == 400 and "not valid JSON" in json.loads(text)["error"]["message"]
        got, _, text = await raw_request(port, "POST", "/v1/completions", length=65 * 1024)
        assert got == 413 and "65536" in json.loads(text)["error"]["message"]
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            await in_thread(lambda: client(port).completions.create(
                model=MODEL, prompt="x", max_tokens=100))     # the server's cap is 64
        assert (await raw_request(port, "POST", "/v1/completions", b"{}"))[0] == 400


async def test_auth_origin_and_draining_follow_the_websocket_rules():
    async with serving(api_key="sesame") as srv:
        with pytest.raises(openai.AuthenticationError):
            await in_thread(lambda: client(srv.port, "wrong").models.list())
        models = await in_thread(lambda: client(srv.port, "sesame").models.list())
        assert models.data[0].id == MODEL
        status, head, _ = await raw_request(srv.port, "GET", "/v1/models",
                                            headers="Authorization: Bearer sesame\r\n"
                                                    "Authorization: Bearer sesame\r\n")
        assert status == 400
    async with serving(allowed_origins=("https://ok.example",), served_model_name="smol") as srv:
        status, _, _ = await raw_request(srv.port, "GET", "/v1/models",
                                         headers="Origin: https://evil.example\r\n")
        assert status == 403
        status, _, body = await raw_request(srv.port, "GET", "/v1/models",
                                            headers="Origin: https://ok.example\r\n")
        assert status == 200 and json.loads(body)["data"][0]["id"] == "smol"
        srv.state.closing = True                       # draining: no new requests
        payload = json.dumps({"model": "smol", "prompt": "x"}).encode()
        status, _, body = await raw_request(srv.port, "POST", "/v1/completions", payload)
        assert status == 503 and json.loads(body)["error"]["type"] == "service_unavailable"
        srv.state.closing = False


async def test_a_long_prefill_streams_progress_comments_before_the_first_token():
    prompt = " ".join(f"item {i}" for i in range(400))              # about 1,600 tokens
    async with serving({"max_num_batched_tokens": 256}) as srv:    # a prefill of 7 chunks
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True})
        status, head, text = await raw_request(srv.port, "POST", "/v1/completions", body.encode())
    assert status == 200 and "text/event-stream" in head
    events = [line for line in text.split("\n") if line.startswith((": prefill", "data: "))]
    comments = [json.loads(e.removeprefix(": prefill ")) for e in events if e.startswith(":")]
    assert comments and events.index(next(e for e in events if e.startswith("data: {"))) > 0
    assert comments[-1]["total"] > 1500 and 0 < comments[-1]["prefilled"] <= comments[-1]["total"]
    assert events[-1] == "data: [DONE]"
