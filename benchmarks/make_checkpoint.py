"""Write a random-weight Hugging Face folder (config, safetensors shards, tokenizer) of a
benchmark shape, for measuring how long a real checkpoint takes to load.

    python benchmarks/make_checkpoint.py qwen3-4b /tmp/qwen3-4b --tokenizer DIR [--device cuda]
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

from common import shaped_model  # noqa: I001


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("shape")
    parser.add_argument("folder")
    parser.add_argument("--tokenizer", required=True, help="a folder with tokenizer.json")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    start = time.perf_counter()
    config = AutoConfig.from_pretrained(shaped_model(args.shape))
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    out = Path(args.folder)
    model.save_pretrained(out, safe_serialization=True)
    for item in Path(args.tokenizer).iterdir():
        if item.is_file():
            shutil.copy(item, out / item.name)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {out}: {size / 2**30:.2f} GiB of safetensors in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
