"""How long a model takes from a fresh process to its first generated token.

    python benchmarks/run.py load_time MODEL [--device cuda] [--repeats 3]

Each run is two new Python processes, each importing astream, building the engine and
generating one token: the first starts with an empty tokenizer cache (`cold_`: a GGUF
file's tokenizer is converted), the second reuses the cache the first filled (`warm_`).
Figures, seconds: `import_s`, `build_s` (engine build until it serves) and `first_token_s`
(process start to the first token). MODEL defaults to SmolLM2 (as does --smoke).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from common import smollm2

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


def add_arguments(parser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="a GGUF file or model folder")


def one_load(model: str, device: str, cache_dir: str) -> dict:
    env = {**os.environ, "ASTREAM_CACHE_DIR": cache_dir}
    proc = subprocess.run([sys.executable, "-c", CHILD, model, device], env=env,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return {k: round(v, 2) for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


def first_and_again(model: str, device: str) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        first = one_load(model, device, cache)
        again = one_load(model, device, cache)
    return {**{f"cold_{k}": v for k, v in first.items()},
            **{f"warm_{k}": v for k, v in again.items()}}


def cases(options):
    model = options.model or smollm2()
    yield {"model": model, "device": options.device}, lambda: first_and_again(model, options.device)
