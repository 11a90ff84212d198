"""Shared helpers of the websocket server tests: a raw wire client, /health probes, frames."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest

from astream import Engine
from astream.server import ServerOptions, StreamServer

ROOT = Path(__file__).resolve().parents[1]
ENGINE_KW = dict(device="cpu", dtype="float32", num_kv_blocks=512, max_model_len=2048)
OPTIONS = dict(port=0, max_tokens_cap=64, max_frame_bytes=64 * 1024, max_requests_per_connection=4,
               progress_interval=0.25)
PROMPTS = ["The quick brown fox", [{"role": "user", "content": "What is the capital of France?"}]]
GREEDY = dict(temperature=0, max_tokens=12)
LONG = dict(temperature=0, max_tokens=64, ignore_eos=True)       # runs until cancelled


async def health(port: int) -> dict:
    """GET /health over plain HTTP, as a monitoring probe would; it must answer 200."""
    status, body = await health_status(port)
    assert status == 200, body
    return body


async def http_get(port: int, path: str, headers: str = "") -> tuple[int, str, str]:
    """A plain HTTP GET on the server's port: (status, head, body), read until it closes."""
    return await http_exchange(port, f"GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
                                     f"{headers}\r\n".encode())


async def http_exchange(port: int, request: bytes) -> tuple[int, str, str]:
    """Send raw request bytes on a fresh connection; (status, head, body), read until it closes."""
    async with await anyio.connect_tcp("127.0.0.1", port) as sock:
        await sock.send(request)
        data = b""
        try:
            while True:
                data += await sock.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            pass
    head, _, body = data.decode().partition("\r\n\r\n")
    return int(head.split()[1]), head, body


async def health_status(port: int) -> tuple[int, dict]:
    """GET /health: the HTTP status and the JSON body."""
    status, head, body = await http_get(port, "/health")
    assert "application/json" in head, head
    return status, json.loads(body)


@asynccontextmanager
async def serving(engine_kw: dict | None = None, **options):
    """A server of its own (for tests that change the engine or the server's options)."""
    async with Engine(**{**ENGINE_KW, **(engine_kw or {})}) as engine:
        async with StreamServer(engine, ServerOptions(**{**OPTIONS, **options})) as srv:
            yield srv


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
    timing = done["timing"]
    assert timing["ttft_ms"] > 0
    assert 0 <= timing["queue_ms"] <= timing["ttft_ms"]      # the queued part of the first token


async def until_refused(port: int) -> None:
    with anyio.fail_after(10):
        while True:
            try:
                sock = await anyio.connect_tcp("127.0.0.1", port)
            except OSError:
                return
            await sock.aclose()
            await anyio.sleep(0.02)


async def served_url(process, log: Path) -> str:
    """Wait until the server's log says where it listens."""
    with anyio.fail_after(120):
        while " on ws://" not in (text := log.read_text()):
            if process.returncode is not None:
                pytest.fail(f"the server exited early:\n{text}")
            await anyio.sleep(0.1)
    return "ws://" + text.split(" on ws://", 1)[1].split()[0]
