"""The longest context one sequence gets in a fixed GPU memory budget, by KV cache dtype.

Qwen3-8B shape (random weights, bf16 weights), resident: the engine is given
`--budget-gib` of the GPU (gpu_memory_utilization = budget / total) and sizes its KV cache
in what the weights and activations leave; max_model_len is then the cache's capacity. To
show the figure is real, one prompt of that length minus 64 tokens is prefilled and
decodes 32 tokens, and the peak memory the process allocated is reported.

    python benchmarks/kv_capacity.py --kv-dtypes auto,fp8_e4m3   # GPU
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from common import save, shaped_model, synthetic_tokenizer  # noqa: I001
from astream import LLM, SamplingParams


def capacity(shape: str, kv: str, budget_gib: float, max_positions: int, tokenizer: str) -> dict:
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.reset_peak_memory_stats()
    with LLM(str(shaped_model(shape, max_positions=max_positions)), load_format="dummy",
             tokenizer=tokenizer, kv_cache_dtype=kv, max_num_seqs=1,
             gpu_memory_utilization=budget_gib * 2**30 / total) as llm:
        stats = llm.stats()
        context = stats["max_model_len"]
        prompt = torch.randint(100, 49152, (context - 64,), generator=torch.Generator().manual_seed(0))
        start = time.perf_counter()
        out = llm.generate([prompt.tolist()], SamplingParams(max_tokens=32, ignore_eos=True))[0]
        seconds = time.perf_counter() - start
    row = {"kv": stats["kv_cache_dtype"], "kv_blocks": stats["kv_blocks_total"],
           "block_size": stats["kv_block_size"], "max_context_tokens": context,
           "ran_prompt_tokens": len(prompt), "generated": len(out.token_ids),
           "seconds": round(seconds, 1), "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--budget-gib", type=float, default=24.0)
    parser.add_argument("--kv-dtypes", default="auto,fp8_e4m3")
    parser.add_argument("--max-positions", type=int, default=262144)
    parser.add_argument("--tokenizer", default=None, help="any tokenizer (prompts are random ids)")
    args = parser.parse_args()
    rows = []
    for kv in args.kv_dtypes.split(","):
        rows.append(capacity(args.shape, kv, args.budget_gib, args.max_positions,
                             args.tokenizer or synthetic_tokenizer()))
        print(rows[-1], flush=True)
    save("kv_capacity", {"shape": args.shape, "budget_gib": args.budget_gib, "rows": rows})


if __name__ == "__main__":
    main()
