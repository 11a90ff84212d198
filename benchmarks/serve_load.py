"""The load generator of benchmarks/serve.py: request schedules, and the client processes.

Each client process has its own event loop and connections, sends its share of the
requests at their scheduled offsets from a start time shared by all processes, and
records per request when it was sent, when each token arrived and when it ended.
Nothing here imports torch or astream, so a process starts in a fraction of a second.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import resource
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from urllib.parse import urlsplit

WS_OPEN_TIMEOUT = 30.0


@dataclass(slots=True)
class Request:
    index: int
    prompt: list[int]
    max_tokens: int
    offset: float = 0.0          # seconds after the shared start
    kind: str = "short"          # "short" or "long" (long-mix)


@dataclass(slots=True)
class RequestResult:
    index: int
    kind: str
    prompt_len: int
    max_tokens: int
    scheduled: float             # perf_counter seconds; the clock is system-wide on Linux
    sent: float = math.nan
    first: float | None = None   # first token
    end: float | None = None     # terminal frame, or the SSE stream's end
    token_times: list[float] = field(default_factory=list)   # each token frame / SSE data chunk
    output_tokens: int = 0
    error: str | None = None
    server_timing: dict | None = None   # astream-ws/1's done frame: the engine's own ttft_ms, queue_ms


@dataclass(slots=True)
class ClientSpec:
    """What one client process needs; picklable for multiprocessing's spawn."""

    worker: int
    protocol: str                # "ws" or "openai"
    url: str                     # http://host:port
    requests: list[Request]
    api_key: str | None = None
    model: str | None = None     # the served model name, sent in OpenAI requests
    temperature: float = 0.0
    seed: int = 0
    max_concurrency: int | None = None
    ws_requests_per_connection: int = 8
    request_timeout: float = 3600.0


@dataclass(slots=True)
class ClientReport:
    worker: int
    results: list[RequestResult]
    cpu_s: float                 # user + system CPU of the process during the run
    wall_s: float
    max_rss_mib: float


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send offsets of n requests: all at 0 for an infinite rate, else a Poisson process
    (exponential gaps of mean 1/rate) that starts with a request at 0."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(n):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


def split_round_robin(requests: list[Request], parts: int) -> list[list[Request]]:
    """Request i goes to part i mod parts, so every part gets early and late arrivals alike."""
    return [requests[i::parts] for i in range(parts) if requests[i::parts]]


def request_params(spec: ClientSpec, request: Request) -> dict:
    params = {"max_tokens": request.max_tokens, "temperature": spec.temperature, "ignore_eos": True}
    if spec.temperature > 0:
        params["seed"] = spec.seed + request.index
    return params


# ---- astream-ws/1 ---------------------------------------------------------------------------

class WsConnection:
    """One websocket carrying several requests at once; a reader task routes frames by id."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.live: dict[str, tuple[RequestResult, asyncio.Future]] = {}
        self.reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def open(cls, spec: ClientSpec) -> "WsConnection":
        from websockets.asyncio.client import connect

        parts = urlsplit(spec.url)
        headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else None
        ws = await connect(f"ws://{parts.netloc}/", additional_headers=headers, compression=None,
                           max_size=None, max_queue=None, proxy=None, open_timeout=WS_OPEN_TIMEOUT)
        return cls(ws)

    async def run(self, spec: ClientSpec, request: Request, result: RequestResult) -> None:
        rid = str(request.index)
        done = asyncio.get_running_loop().create_future()
        self.live[rid] = (result, done)
        frame = json.dumps({"type": "generate", "id": rid, "prompt": request.prompt,
                            "params": request_params(spec, request)})
        result.sent = time.perf_counter()
        await self.ws.send(frame)
        await done

    async def _read(self) -> None:
        error = "connection closed"
        try:
            async for message in self.ws:
                now = time.perf_counter()
                frame = json.loads(message)
                entry = self.live.get(frame.get("id"))
                if entry is None:
                    continue
                result, done = entry
                kind = frame.get("type")
                if kind == "token":
                    if frame.get("token_id") is None:      # held-back text, not a token
                        continue
                    if result.first is None:
                        result.first = now
                    result.token_times.append(now)
                elif kind == "done":
                    result.end = now
                    result.server_timing = frame.get("timing")
                    result.output_tokens = frame.get("usage", {}).get("completion_tokens",
                                                                       len(result.token_times))
                    if frame.get("finish_reason") not in ("length", "stop"):
                        result.error = f"finish_reason {frame.get('finish_reason')}"
                    self._finish(frame["id"], done)
                elif kind == "error":
                    result.end = now
                    result.error = f"{frame.get('code')}: {frame.get('message')}"
                    self._finish(frame["id"], done)
        except Exception as exc:                  # a reset connection fails its live requests below
            error = f"connection lost: {exc!r}"
        for rid, (result, done) in list(self.live.items()):
            result.error = result.error or error
            self._finish(rid, done)

    def _finish(self, rid: str, done: asyncio.Future) -> None:
        del self.live[rid]
        if not done.done():
            done.set_result(None)

    async def close(self) -> None:
        await self.ws.close()
        await self.reader


# ---- OpenAI /v1/completions with SSE, over plain HTTP/1.1 ----------------------------------

class HttpConnection:
    """A keep-alive HTTP/1.1 connection; enough of the protocol for JSON POSTs answered with
    an SSE stream (chunked, or delimited by Content-Length or the connection's end)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.reusable = False            # True only between complete exchanges
        self.delimited = True            # the last body had a known end (not the connection's)
        self.answered = False            # the last request got a response head

    @classmethod
    async def open(cls, host: str, port: int) -> "HttpConnection":
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 22)
        return cls(reader, writer)

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except OSError:
            pass

    async def post_events(self, head: bytes, body: bytes, result: RequestResult) -> None:
        self.reusable = self.answered = False
        result.sent = time.perf_counter()
        self.writer.write(head + body)
        await self.writer.drain()
        status, headers = await self._read_head()
        self.answered = True
        keep_alive = headers.get("connection", "").lower() != "close"
        stream = SseStream(result)
        if status != 200:
            raw = b"".join([chunk async for chunk in self._body(headers)])
            result.end = time.perf_counter()
            result.error = f"HTTP {status}: {raw[:300].decode(errors='replace')}"
        else:
            async for chunk in self._body(headers):
                stream.feed(chunk, time.perf_counter())
            result.end = result.end or time.perf_counter()
            if not stream.finished and result.error is None:
                result.error = "the stream ended without data: [DONE]"
        self.reusable = keep_alive and self.delimited

    async def _read_head(self) -> tuple[int, dict[str, str]]:
        line = await self.reader.readline()
        if not line:
            raise ConnectionError("the server closed the connection")
        status = int(line.split()[1])
        headers = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    async def _body(self, headers: dict[str, str]):
        self.delimited = True
        if "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                size = int((await self.reader.readline()).split(b";")[0], 16)
                if size == 0:
                    while (await self.reader.readline()) not in (b"\r\n", b"\n", b""):
                        pass                          # trailers
                    return
                data = await self.reader.readexactly(size + 2)
                yield data[:-2]
        elif "content-length" in headers:
            yield await self.reader.readexactly(int(headers["content-length"]))
        else:
            self.delimited = False
            while data := await self.reader.read(1 << 16):
                yield data


class SseStream:
    """Parses server-sent events of an OpenAI completion stream into a RequestResult: each
    data chunk with text is one token event; the usage chunk gives the token count."""

    def __init__(self, result: RequestResult) -> None:
        self.result = result
        self.buffer = b""
        self.finished = False

    def feed(self, data: bytes, now: float) -> None:
        self.buffer = (self.buffer + data).replace(b"\r\n", b"\n")
        *events, self.buffer = self.buffer.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._data(line[5:].strip(), now)

    def _data(self, payload: bytes, now: float) -> None:
        result = self.result
        if payload == b"[DONE]":
            self.finished = True
            result.end = now
            return
        chunk = json.loads(payload)
        if "error" in chunk:
            result.error = f"stream error: {chunk['error'].get('message')}"
            return
        choices = chunk.get("choices") or []
        if choices and choices[0].get("text"):
            if result.first is None:
                result.first = now
            result.token_times.append(now)
        if choices and choices[0].get("finish_reason") not in (None, "length", "stop"):
            result.error = f"finish_reason {choices[0]['finish_reason']}"
        if chunk.get("usage"):
            result.output_tokens = chunk["usage"]["completion_tokens"]


class HttpPool:
    """Idle keep-alive connections, opened before the start so no connect lands in a TTFT."""

    def __init__(self, spec: ClientSpec) -> None:
        parts = urlsplit(spec.url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.idle: list[HttpConnection] = []
        auth = f"Authorization: Bearer {spec.api_key}\r\n" if spec.api_key else ""
        self.head = (f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                     f"Content-Type: application/json\r\nAccept: text/event-stream\r\n{auth}")

    async def fill(self, count: int) -> None:
        self.idle += await asyncio.gather(*(HttpConnection.open(self.host, self.port) for _ in range(count)))

    async def run(self, spec: ClientSpec, request: Request, result: RequestResult) -> None:
        body = {"prompt": request.prompt, "stream": True, "stream_options": {"include_usage": True},
                **request_params(spec, request)}
        if spec.model:
            body["model"] = spec.model
        data = json.dumps(body).encode()
        head = f"{self.head}Content-Length: {len(data)}\r\n\r\n".encode()
        conn = await self._connection()
        try:
            await conn.post_events(head, data, result)
        except ConnectionError:
            # An idle connection the server closed (its keep-alive timeout) before it answered:
            # send the request again on a fresh one.
            await conn.close()
            if conn.answered:
                raise
            conn = await HttpConnection.open(self.host, self.port)
            await conn.post_events(head, data, result)
        finally:
            if conn.reusable:
                self.idle.append(conn)
            else:
                await conn.close()

    async def _connection(self) -> HttpConnection:
        while self.idle:
            conn = self.idle.pop()
            if not conn.reader.at_eof():
                return conn
            await conn.close()
        return await HttpConnection.open(self.host, self.port)

    async def close(self) -> None:
        await asyncio.gather(*(conn.close() for conn in self.idle))


# ---- one client process ------------------------------------------------------------------------

async def _run(spec: ClientSpec, control: Connection) -> ClientReport:
    requests = spec.requests
    if spec.protocol == "ws":
        # Request i always uses connection i mod n: none carries more than its share.
        per = spec.ws_requests_per_connection
        count = max(1, min(len(requests), math.ceil(len(requests) / per)))
        conns = await asyncio.gather(*(WsConnection.open(spec) for _ in range(count)))
        send = [conns[i % count].run for i in range(len(requests))]
    elif spec.protocol == "openai":
        pool = HttpPool(spec)
        await pool.fill(min(len(requests), spec.max_concurrency or len(requests)))
        send = [pool.run] * len(requests)
    else:
        raise ValueError(f"unknown protocol {spec.protocol!r}")
    control.send("ready")
    start = await asyncio.to_thread(control.recv)
    limit = asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency else None

    async def one(i: int, request: Request) -> RequestResult:
        result = RequestResult(request.index, request.kind, len(request.prompt), request.max_tokens,
                               scheduled=start + request.offset)
        await asyncio.sleep(max(0.0, result.scheduled - time.perf_counter()))
        try:
            if limit is None:
                await asyncio.wait_for(send[i](spec, request, result), spec.request_timeout)
            else:
                async with limit:
                    await asyncio.wait_for(send[i](spec, request, result), spec.request_timeout)
        except Exception as exc:
            result.error = result.error or f"{type(exc).__name__}: {exc}"
            result.end = result.end or time.perf_counter()
        return result

    cpu0 = time.process_time()
    results = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - start
    if spec.protocol == "ws":
        await asyncio.gather(*(conn.close() for conn in conns), return_exceptions=True)
    else:
        await pool.close()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return ClientReport(spec.worker, list(results), cpu, wall, rss)


def client_main(spec: ClientSpec, control: Connection) -> None:
    """Entry point of a client process: connect, say "ready", wait for the shared start time,
    run, send back a ClientReport (or the error's text)."""
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        control.send(runner(_run(spec, control)))
    except BaseException as exc:
        control.send(f"client {spec.worker} failed: {type(exc).__name__}: {exc}")
        raise
