"""How long a model takes from a fresh process to its first generated token.

Each measurement is a new Python process: `import astream`, build the engine, generate one
token. "first" starts with an empty tokenizer cache (a GGUF file's tokenizer is converted),
"again" reuses the cache the first run filled. Prints min / median / max over --repeat runs.

    python benchmarks/load_time.py MODEL [--device cuda] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from common import save  # noqa: I001

CHILD = """
import json, sys, time
start = time.perf_counter()
from astream import LLM, SamplingParams
imported = time.perf_counter()
with LLM(sys.argv[1], device=sys.argv[2], max_model_len=2048) as llm:
    ready = time.perf_counter()
    llm.generate(["Hello"], SamplingParams(max_tokens=1))
    served = time.perf_counter()
print(json.dumps({"import_s": imported - start, "build_s": ready - imported,
                  "first_token_s": served - start}))
"""


def one_load(model: str, device: str, cache_dir: str) -> dict:
    env = {**os.environ, "ASTREAM_CACHE_DIR": cache_dir}
    proc = subprocess.run([sys.executable, "-c", CHILD, model, device], env=env,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return {k: round(v, 2) for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


def spread(rows: list[dict], key: str) -> str:
    values = sorted(r[key] for r in rows)
    return f"{values[0]} / {values[len(values) // 2]} / {values[-1]}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--name", default="load_time")
    args = parser.parse_args()
    first, again = [], []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as cache:
            first.append(one_load(args.model, args.device, cache))
            again.append(one_load(args.model, args.device, cache))
            print(first[-1], again[-1], flush=True)
    for label, rows in (("first", first), ("again", again)):
        print(f"{label:<6} to first token (s, min / median / max): {spread(rows, 'first_token_s')}"
              f"   import: {spread(rows, 'import_s')}   engine build: {spread(rows, 'build_s')}")
    save(args.name, {"model": args.model, "device_arg": args.device, "first": first, "again": again})


if __name__ == "__main__":
    main()
