"""Talk to `astream serve` with the official `openai` client (pip install openai).

    astream serve &                                   # http://127.0.0.1:8765/v1
    python examples/openai_client.py                  # or: --base-url http://host:port/v1 --api-key KEY

One chat answer streamed token by token, then one plain completion answered whole, with
its token usage. Any OpenAI-compatible tool can point at the same base URL.
"""

from __future__ import annotations

import argparse
import os
import sys

import openai


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default="http://127.0.0.1:8765/v1")
    parser.add_argument("--api-key", default=os.environ.get("ASTREAM_API_KEY", "none"))
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    print(f"model: {model}\nQ: What is the capital of France?\nA: ", end="", flush=True)
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=48, temperature=0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    done = client.completions.create(model=model, prompt="The three primary colours are",
                                     max_tokens=16, temperature=0)
    print(f"\n\nThe three primary colours are{done.choices[0].text}\n"
          f"({done.usage.prompt_tokens} prompt + {done.usage.completion_tokens} generated tokens, "
          f"finish {done.choices[0].finish_reason})")


if __name__ == "__main__":
    try:
        main()
    except openai.APIConnectionError as exc:
        sys.exit(f"no astream server at {exc.request.url.copy_with(path='/')} ({exc.message}); "
                 "start one with `astream serve` (then run this again), or pass --base-url")
