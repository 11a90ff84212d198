"""Embed the Engine in a small async web application (no web framework needed).

    python examples/embed_in_web_app.py                  # http://127.0.0.1:8080
    curl -N "http://127.0.0.1:8080/generate?prompt=Tell+me+a+joke&max_tokens=64"

GET /generate streams the answer as Server-Sent Events while the engine produces it:
one `data: {"text": ...}` event per token, then an `event: done` with the finish
reason. Requests run concurrently and share the engine's batches; a client that hangs
up cancels its request (leaving `engine.stream` early aborts it). Like the Engine,
this runs on asyncio, uvloop or trio: it only uses anyio's TCP streams.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

import anyio
from anyio.abc import SocketStream

from astream import Engine, SamplingParams

MAX_HEAD_BYTES = 16 * 1024
SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
            b"Cache-Control: no-cache\r\nConnection: close\r\n\r\n")


@dataclass(slots=True)
class App:
    engine: Engine

    async def handle(self, stream: SocketStream) -> None:
        async with stream:
            try:
                method, target = await read_request_line(stream)
            except (anyio.EndOfStream, anyio.BrokenResourceError, ValueError):
                return
            url = urlsplit(target)
            if method != "GET" or url.path != "/generate":
                return await respond(stream, 404, "try GET /generate?prompt=...\n")
            try:
                prompt, params = parse_query(url.query)
            except ValueError as exc:
                return await respond(stream, 400, f"{exc}\n")
            try:
                await self.stream_events(stream, prompt, params)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass                             # the client left; the request was aborted

    async def stream_events(self, stream: SocketStream, prompt: str, params: SamplingParams) -> None:
        await stream.send(SSE_HEAD)
        try:
            async for tok in self.engine.stream(prompt, params):
                if tok.text:
                    await stream.send(sse({"text": tok.text}))
                if tok.finish_reason is not None:
                    await stream.send(sse({"finish_reason": tok.finish_reason}, "done"))
        except ValueError as exc:                # e.g. a prompt longer than max_model_len
            await stream.send(sse({"error": str(exc)}, "error"))


async def read_request_line(stream: SocketStream) -> tuple[str, str]:
    head = b""
    while b"\r\n\r\n" not in head:
        if len(head) > MAX_HEAD_BYTES:
            raise ValueError("request head too large")
        head += await stream.receive()
    method, target, _version = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
    return method, target


def parse_query(query: str) -> tuple[str, SamplingParams]:
    fields = {key: values[0] for key, values in parse_qs(query).items()}
    prompt = fields.get("prompt", "")
    if not prompt:
        raise ValueError("the query needs a non-empty prompt=")
    params = SamplingParams(temperature=float(fields.get("temperature", 0.7)),
                            max_tokens=int(fields.get("max_tokens", 128)))
    return prompt, params


async def respond(stream: SocketStream, status: int, text: str) -> None:
    body = text.encode()
    reason = {400: "Bad Request", 404: "Not Found"}[status]
    await stream.send(f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
                      f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)


def sse(data: dict, event: str | None = None) -> bytes:
    prefix = f"event: {event}\n" if event else ""
    return f"{prefix}data: {json.dumps(data)}\n\n".encode()


async def main(args: argparse.Namespace) -> None:
    async with Engine(args.model) as engine:
        listener = await anyio.create_tcp_listener(local_host=args.host, local_port=args.port)
        print(f"listening: curl -N 'http://{args.host}:{args.port}/generate?prompt=Hello'",
              file=sys.stderr)
        await listener.serve(App(engine).handle)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    try:
        anyio.run(main, parser.parse_args())
    except KeyboardInterrupt:
        pass
