"""Where a fresh process spends its time until the engine serves: wall-clock phases
(import torch, CUDA init, import astream, build the engine core, a second build in the same
process, first token) and a cProfile of the first build, its heaviest functions by
cumulative time. The core is built on this thread (as the engine does on a worker).

    python benchmarks/load_profile.py MODEL [--device cuda] [--top 40]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import time

start = time.perf_counter()
import torch  # noqa: E402

torch_imported = time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    if args.device == "cuda":
        torch.cuda.init()
    cuda_ready = time.perf_counter()
    from astream.config import EngineConfig
    from astream.core import EngineCore
    from astream.sampling import SamplingParams
    imported = time.perf_counter()
    config = EngineConfig.from_kwargs(args.model, device=args.device, max_model_len=2048)
    profiler = cProfile.Profile()
    profiler.enable()
    core = EngineCore.create(config)
    profiler.disable()
    built = time.perf_counter()
    sink = core.add_request("hello", core.tokenize("Hello"), SamplingParams(max_tokens=1))
    while not sink.tokens:
        core.step()
    served = time.perf_counter()
    core.close()
    del core, sink                      # what Engine does on exit: the device memory goes back
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    again = time.perf_counter()
    EngineCore.create(config).close()
    rebuilt = time.perf_counter()
    print(f"import torch {torch_imported - start:.2f} s, CUDA init {cuda_ready - torch_imported:.2f} s, "
          f"import astream {imported - cuda_ready:.2f} s, build (profiled) {built - imported:.2f} s, "
          f"first token {served - built:.2f} s; total {served - start:.2f} s; "
          f"a second build in this process {rebuilt - again:.2f} s")
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(args.top)
    print(text.getvalue())


if __name__ == "__main__":
    main()
