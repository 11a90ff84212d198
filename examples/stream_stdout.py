"""Stream a completion to stdout with the async Engine.

    python examples/stream_stdout.py "Write a haiku about the sea."
    python examples/stream_stdout.py --chat "What is the capital of France?"

With no --model the embedded SmolLM2-135M-Instruct runs (on the GPU if there is one).
"""

from __future__ import annotations

import argparse
import sys

import anyio

from astream import Engine, SamplingParams


async def main(args: argparse.Namespace) -> None:
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    async with Engine(args.model) as engine:
        async for tok in engine.stream(prompt, params):
            sys.stdout.write(tok.text)
            sys.stdout.flush()
    sys.stdout.write("\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt")
    parser.add_argument("--chat", action="store_true")
    parser.add_argument("--model")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7)
    anyio.run(main, parser.parse_args())
