"""Talk to `astream serve` over its websocket: concurrent streams on one connection.

    astream serve &                                   # ws://127.0.0.1:8765
    python examples/websocket_client.py               # or: --url ws://host:port --api-key KEY

Three questions are asked at once on one connection; their tokens arrive interleaved
and are printed as each answer completes. A fourth request is left early after a few
tokens, which cancels it on the server.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import aclosing

import anyio

from astream.face.client import Client

QUESTIONS = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?"]


async def ask(client: Client, question: str) -> None:
    text, done = await client.generate([{"role": "user", "content": question}],
                                       max_tokens=48, temperature=0)
    usage, timing = done["usage"], done["timing"]
    print(f"Q: {question}\nA: {text.strip()}\n   ({usage['completion_tokens']} tokens, "
          f"finish {done['finish_reason']}, first token after {timing['ttft_ms']:.0f} ms)\n")


async def leave_early(client: Client) -> None:
    async with aclosing(client.stream("Tell me a very long story.", max_tokens=256)) as tokens:
        async for tok in tokens:
            if tok.index == 5:
                break                          # sends a cancel frame; the server frees the request
    print("(the long story was cancelled after 6 tokens)\n")


async def main(args: argparse.Namespace) -> None:
    async with Client(args.url, api_key=args.api_key) as client:
        async with anyio.create_task_group() as group:
            for question in QUESTIONS:
                group.start_soon(ask, client, question)
            group.start_soon(leave_early, client)
        print("streamed: ", end="")
        async for tok in client.stream("Once upon a time", max_tokens=32, temperature=0.8, seed=7):
            print(tok.text, end="", flush=True)
        print()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="ws://127.0.0.1:8765")
    parser.add_argument("--api-key", default=os.environ.get("ASTREAM_API_KEY"))
    args = parser.parse_args()
    try:
        anyio.run(main, args)
    except OSError as exc:                     # connection refused, unknown host: no server there
        sys.exit(f"no astream server at {args.url} ({exc.strerror or exc}); start one with "
                 "`astream serve` (then run this again), or pass --url")
