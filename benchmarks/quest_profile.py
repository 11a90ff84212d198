"""Where a Quest decode step's time goes: torch profiler over a few synchronous steps.

    python benchmarks/quest_profile.py --tokenizer DIR [--offload] [--budget 2048] [--ctx 32768]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from common import shaped_model  # noqa: I001
from astream.config import EngineConfig
from astream.core import EngineCore
from astream.policies import QuestPolicy
from astream.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--ctx", type=int, default=32768)
    parser.add_argument("--eager", action="store_true")
    args = parser.parse_args()
    config = EngineConfig(model=str(shaped_model("qwen3-4b", max_positions=args.ctx + 1024)),
                          load_format="dummy", tokenizer=args.tokenizer, device="cuda",
                          dtype="bfloat16", max_num_seqs=1, max_model_len=args.ctx + 1024,
                          offload=args.offload, enforce_eager=args.eager,
                          sparse_policy=QuestPolicy(budget_tokens=args.budget),
                          max_num_batched_tokens=16384)
    core = EngineCore.create(config)
    prompt = torch.randint(100, 49152, (args.ctx,)).tolist()
    sink = core.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True))
    while not sink.tokens:
        core.step()
    for _ in range(3):
        core.step()
    core.runtime.synchronize()
    times = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            start = time.perf_counter()
            core.step()
            core.runtime.synchronize()
            times.append(round((time.perf_counter() - start) * 1e3, 2))
    print("step ms:", times)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=22, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
