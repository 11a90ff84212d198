"""Cancel, disconnect, API key, shutdown and SIGTERM: every request ends and frees its KV."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import anyio
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosedOK, InvalidStatus

from astream.face.client import Client
from astream.server import ServerOptions, StreamServer
from server_helpers import LONG, OPTIONS, ROOT, Wire, cut_short, generate, health, served_url, until_refused, wait_idle


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
    command = [sys.executable, "-m", "astream.face.cli", "serve", "--port", "0", "--device", "cpu",
               "--dtype", "float32", "--num-kv-blocks", "512", "--max-model-len", "2048",
               "--shutdown-timeout", "120"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    log = tmp_path / "server.log"
    with log.open("w") as stderr:
        process = await anyio.open_process(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                           stderr=stderr)
    try:
        url = await served_url(process, log)
        async with connect(url) as ws:
            wire = Wire(ws)
            await wire.send(generate("r", "Tell me a long story.", temperature=0, max_tokens=32,
                                     ignore_eos=True))
            first = await wire.first_token("r")
            process.send_signal(signal.SIGTERM)
            await until_refused(int(url.rsplit(":", 1)[1]))      # it stopped accepting
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
