"""The websocket server, seen from real clients on a loopback port: protocol astream-ws/1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from contextlib import aclosing
from pathlib import Path

import anyio
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, ConnectionClosedOK, InvalidStatus

from astream import Engine, SamplingParams
from astream.client import Client, ServerError
from astream.server import ServerOptions, StreamServer

ROOT = Path(__file__).resolve().parents[1]
ENGINE_KW = dict(device="cpu", dtype="float32", num_kv_blocks=512, max_model_len=2048)
OPTIONS = dict(port=0, max_tokens_cap=64, max_frame_bytes=64 * 1024, max_requests_per_connection=4,
               progress_interval=0.25)
PROMPTS = ["The quick brown fox", [{"role": "user", "content": "What is the capital of France?"}]]
GREEDY = dict(temperature=0, max_tokens=12)
LONG = dict(temperature=0, max_tokens=64, ignore_eos=True)       # runs until cancelled


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def expected(smol_llm):
    return [smol_llm.generate([p], SamplingParams(**GREEDY))[0] for p in PROMPTS]


@pytest.fixture(scope="module")
async def server():
    async with Engine(**ENGINE_KW) as engine:
        async with StreamServer(engine, ServerOptions(**OPTIONS)) as srv:
            yield srv


@pytest.fixture(scope="module")
async def idle_free(server):
    return (await health(server.port))["kv_blocks_free"]


# ---- helpers -------------------------------------------------------------------------------

async def health(port: int) -> dict:
    """GET /health over plain HTTP, as a monitoring probe would."""
    async with await anyio.connect_tcp("127.0.0.1", port) as sock:
        await sock.send(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        data = b""
        try:
            while True:
                data += await sock.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            pass
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"application/json" in head
    return json.loads(body)


async def wait_idle(port: int, idle_free: int, timeout: float = 20) -> dict:
    """Poll /health until every request is gone and the KV blocks are back."""
    stats = {}
    with anyio.move_on_after(timeout):
        while True:
            stats = await health(port)
            if stats["kv_blocks_free"] == idle_free and stats["live_requests"] == 0 \
                    and stats["requests"] == 0 and stats["running"] == 0:
                return stats
            await anyio.sleep(0.05)
    pytest.fail(f"the server did not return to idle within {timeout} s: {stats}")


def cut_short(before: dict, after: dict) -> bool:
    """The engine stopped well before LONG's 64 tokens: the requests were aborted, not finished."""
    return after["steps"] - before["steps"] < LONG["max_tokens"] // 2


def generate(request_id: str, prompt, **params) -> dict:
    field = "messages" if isinstance(prompt, list) else "prompt"
    return {"type": "generate", "id": request_id, field: prompt, "params": params}


class Wire:
    """A raw websocket client that files incoming frames by request id."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.backlog: list[dict] = []

    async def send(self, frame) -> None:
        await self.ws.send(frame if isinstance(frame, (str, bytes)) else json.dumps(frame))

    async def next(self, match, timeout: float = 60) -> dict:
        for i, frame in enumerate(self.backlog):
            if match(frame):
                return self.backlog.pop(i)
        with anyio.fail_after(timeout):
            while True:
                frame = json.loads(await self.ws.recv())
                if match(frame):
                    return frame
                self.backlog.append(frame)

    async def error(self) -> dict:
        return await self.next(lambda f: f["type"] == "error")

    async def until_end(self, request_id: str) -> list[dict]:
        frames = []
        while not frames or frames[-1]["type"] not in ("done", "error"):
            frames.append(await self.next(lambda f: f.get("id") == request_id))
        return frames

    async def first_token(self, request_id: str) -> dict:
        return await self.next(lambda f: f.get("id") == request_id and f["type"] == "token")


def check_against(frames: list[dict], completion) -> None:
    """Token frames and the done frame agree with the offline API's completion."""
    kinds = [f["type"] for f in frames]
    progress = kinds.count("progress")                # heartbeats while a prefill waits
    assert kinds == ["progress"] * progress + ["token"] * (len(frames) - progress - 1) + ["done"]
    tokens, done = frames[progress:-1], frames[-1]
    assert [f["index"] for f in tokens] == list(range(len(tokens)))
    assert [f["token_id"] for f in tokens] == completion.token_ids
    assert "".join(f["text"] for f in tokens) == completion.text
    assert done["type"] == "done" and done["finish_reason"] == completion.finish_reason
    assert done["usage"] == {"prompt_tokens": len(completion.prompt_token_ids),
                             "completion_tokens": len(completion.token_ids)}
    assert done["timing"]["ttft_ms"] > 0


# ---- tests -----------------------------------------------------------------------------------

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
async def test_cancel_mid_stream_ends_with_abort_and_frees_kv(server, idle_free):
    async with connect(server.url) as ws:
        wire = Wire(ws)
        await wire.send(generate("c", "Tell me a long story.", **LONG))
        for _ in range(3):
            await wire.first_token("c")
        assert (await health(server.port))["kv_blocks_free"] < idle_free
        await wire.send({"type": "cancel", "id": "c"})
        frames = await wire.until_end("c")
        assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "abort"
        assert 3 <= frames[-1]["usage"]["completion_tokens"] < 64
        await wire.send(generate("c", "Tell me a long story.", **LONG))     # the id is free again
        await wire.first_token("c")
        await wire.send({"type": "cancel", "id": "c"})
        assert (await wire.until_end("c"))[-1]["finish_reason"] == "abort"
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


BAD_FRAMES = [
    ("not json", "invalid_json", None),
    (b"\x00\x01binary", "binary_frame", None),
    ('["a", "list"]', "invalid_field", None),
    ({"type": "summon", "id": "x"}, "unknown_type", "x"),
    ({"type": "generate", "id": "x"}, "invalid_field", "x"),
    ({"type": "generate", "id": 7, "prompt": "hi"}, "invalid_field", None),
    ({"type": "generate", "id": "x", "prompt": ""}, "invalid_field", "x"),
    ({"type": "generate", "id": "x", "prompt": "hi", "parms": {}}, "unknown_field", "x"),
    (generate("x", "hi", temperature="hot"), "invalid_field", "x"),
    (generate("x", "hi", top_p=2.0), "invalid_field", "x"),
    (generate("x", "hi", max_tokens=8, beam_width=4), "unknown_param", "x"),
    (generate("x", "hi", max_tokens=65), "max_tokens_cap", "x"),
    (generate("x", "hello " * 2100, max_tokens=8), "prompt_too_long", "x"),
    ({"type": "cancel", "id": "nobody"}, "unknown_id", "nobody"),
]


@pytest.mark.anyio
async def test_bad_input_gets_error_frames_and_the_connection_goes_on(server, expected, idle_free):
    async with connect(server.url) as ws:
        wire = Wire(ws)
        await wire.send(generate("bg", PROMPTS[0], **GREEDY))      # must go on meanwhile
        for frame, code, request_id in BAD_FRAMES:
            await wire.send(frame)
            error = await wire.error()
            assert (error["code"], error["id"]) == (code, request_id), (frame, error)
            assert error["message"]
        check_against(await wire.until_end("bg"), expected[0])
        await wire.send(generate("dup", "Tell me a long story.", **LONG))
        await wire.send(generate("dup", "hi", max_tokens=4))
        assert (await wire.error())["code"] == "duplicate_id"
        for i in range(3):                                       # the limit is 4 live requests
            await wire.send(generate(f"fill{i}", "Tell me a long story.", **LONG))
        await wire.send(generate("fifth", "hi", max_tokens=4))
        assert (await wire.error()) == {"type": "error", "id": "fifth", "code": "too_many_requests",
                                        "message": "this connection already has 4 live requests, "
                                                   "the server's limit"}
        for request_id in ("dup", "fill0", "fill1", "fill2"):
            await wire.send({"type": "cancel", "id": request_id})
        for request_id in ("dup", "fill0", "fill1", "fill2"):
            assert (await wire.until_end(request_id))[-1]["finish_reason"] == "abort"
        await wire.send(generate("after", PROMPTS[1], **GREEDY))
        check_against(await wire.until_end("after"), expected[1])
    await wait_idle(server.port, idle_free)


@pytest.mark.anyio
async def test_oversize_frame_closes_1009_and_frees_requests(server, idle_free):
    async with connect(server.url) as ws:
        wire = Wire(ws)
        await wire.send(generate("long", "Tell me a long story.", **LONG))
        await wire.first_token("long")
        before = await health(server.port)
        await wire.send(generate("big", "a" * (OPTIONS["max_frame_bytes"] + 1)))
        with pytest.raises(ConnectionClosed):
            await wire.until_end("long")
        assert ws.close_code == 1009
    assert cut_short(before, await wait_idle(server.port, idle_free))


@pytest.mark.anyio
async def test_disconnect_mid_stream_frees_kv(server, idle_free):
    ws = await connect(server.url)
    wire = Wire(ws)
    for i in range(3):
        await wire.send(generate(f"d{i}", "Tell me a long story.", **LONG))
    for i in range(3):
        await wire.first_token(f"d{i}")
    before = await health(server.port)
    assert before["live_requests"] == 3 and before["kv_blocks_free"] < idle_free
    ws.transport.abort()                                  # no close handshake: the network went away
    assert cut_short(before, await wait_idle(server.port, idle_free))


@pytest.mark.anyio
async def test_api_key(server, idle_free):
    async with StreamServer(server.engine, ServerOptions(**OPTIONS, api_key="s3cret")) as keyed:
        for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            with pytest.raises(InvalidStatus) as refused:
                await connect(keyed.url, additional_headers=headers)
            assert refused.value.response.status_code == 401
        async with Client(keyed.url, api_key="s3cret") as client:
            text, done = await client.generate("Hi", temperature=0, max_tokens=4)
        assert done["finish_reason"] in ("stop", "length") and text
        assert (await health(keyed.port))["status"] == "ok"      # /health needs no key


@pytest.mark.anyio
async def test_shutdown_aborts_what_outlives_the_grace_period(server, idle_free):
    async with StreamServer(server.engine, ServerOptions(**OPTIONS)) as second:
        async with connect(second.url) as ws:
            wire = Wire(ws)
            await wire.send(generate("slow", "Tell me a long story.", **LONG))
            await wire.first_token("slow")
            async with anyio.create_task_group() as group:
                group.start_soon(second.shutdown, 0.3)
                assert (await wire.until_end("slow"))[-1]["finish_reason"] == "abort"
                with pytest.raises(ConnectionClosedOK):
                    await ws.recv()
            assert ws.close_code == 1001
    await wait_idle(server.port, idle_free)


@pytest.mark.anyio
async def test_sigterm_finishes_in_flight_requests_and_exits_0(tmp_path):
    command = [sys.executable, "-m", "astream.cli", "serve", "--port", "0", "--device", "cpu",
               "--dtype", "float32", "--num-kv-blocks", "512", "--max-model-len", "2048",
               "--shutdown-timeout", "120"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    log = tmp_path / "server.log"
    with log.open("w") as stderr:
        process = await anyio.open_process(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                           stderr=stderr)
    try:
        url = await _served_url(process, log)
        async with connect(url) as ws:
            wire = Wire(ws)
            await wire.send(generate("r", "Tell me a long story.", temperature=0, max_tokens=32,
                                     ignore_eos=True))
            first = await wire.first_token("r")
            process.send_signal(signal.SIGTERM)
            await _until_refused(int(url.rsplit(":", 1)[1]))      # it stopped accepting
            await wire.send(generate("late", "hi", max_tokens=4))
            assert (await wire.error())["code"] == "shutting_down"
            frames = [first] + await wire.until_end("r")
            with pytest.raises(ConnectionClosedOK):
                await ws.recv()
            assert ws.close_code == 1001
        with anyio.fail_after(30):
            assert await process.wait() == 0, log.read_text()
    finally:
        if process.returncode is None:
            process.kill()
        await process.aclose()
    assert [f["type"] for f in frames] == ["token"] * 32 + ["done"]   # finished, not cut short
    assert frames[-1]["finish_reason"] == "length"
    assert frames[-1]["usage"]["completion_tokens"] == 32


async def _until_refused(port: int) -> None:
    with anyio.fail_after(10):
        while True:
            try:
                sock = await anyio.connect_tcp("127.0.0.1", port)
            except OSError:
                return
            await sock.aclose()
            await anyio.sleep(0.02)


async def _served_url(process, log: Path) -> str:
    """Wait until the server's log says where it listens."""
    with anyio.fail_after(120):
        while " on ws://" not in (text := log.read_text()):
            if process.returncode is not None:
                pytest.fail(f"the server exited early:\n{text}")
            await anyio.sleep(0.1)
    return "ws://" + text.split(" on ws://", 1)[1].split()[0]
