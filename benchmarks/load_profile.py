"""Where a fresh process spends its time until the engine serves: wall-clock phases
(import torch, CUDA init, import astream, build the engine core, a second build in the same
process, first token), the build's own phases (checkpoint, weights, tokenizer, runner,
CUDA graphs, ...; nested ones are included in their parent), and with --cprofile a
profile of the first build, its heaviest functions by cumulative time (the profiler slows
it down). The core is built on this thread (as the engine does on a worker).

    python benchmarks/load_profile.py MODEL [--device cuda] [--cprofile] [--top 40]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import sys
import time

HEAVY_IMPORTS = ("transformers", "sympy", "sklearn", "scipy", "torch._dynamo",
                 "torch.distributed.fsdp")

# (module, attribute) called during EngineCore.create, timed by wrapping the attribute
BUILD_PHASES = (("astream.core.engine_core", "open_checkpoint"), ("astream.core.engine_core", "load_model"),
                ("astream.models.loader", "load_tokenizer"), ("astream.core.engine_core", "plan_cache"),
                ("astream.core.engine_core", "build_runner"), ("astream.executor.build", "build_graphs"),
                ("astream.core.engine_core", "BlockManager"), ("astream.core.engine_core", "stop_token_ids"))

start = time.perf_counter()
import torch  # noqa: E402

torch_imported = time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    if args.device == "cuda":
        torch.cuda.init()
    cuda_ready = time.perf_counter()
    from astream.base.config import EngineConfig
    from astream.base.sampling import SamplingParams
    from astream.core.engine_core import EngineCore
    imported = time.perf_counter()
    config = EngineConfig.from_kwargs(args.model, device=args.device, max_model_len=2048)
    phases: dict[str, float] = {}
    timed_build_phases(phases)
    profiler = cProfile.Profile()
    if args.cprofile:
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
          f"import astream {imported - cuda_ready:.2f} s, build {built - imported:.2f} s, "
          f"first token {served - built:.2f} s; total {served - start:.2f} s; "
          f"a second build in this process {rebuilt - again:.2f} s")
    print("first build's phases: " + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in phases.items()))
    heavy = [name for name in HEAVY_IMPORTS if name in sys.modules]
    print(f"heavy packages imported: {', '.join(heavy) or 'none'}")
    if not args.cprofile:
        return
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(args.top)
    print(text.getvalue())


def timed_build_phases(phases: dict[str, float]) -> None:
    """Wrap each of BUILD_PHASES so that its first call's wall time lands in `phases`."""
    import importlib

    for module_name, attribute in BUILD_PHASES:
        module = importlib.import_module(module_name)
        original = getattr(module, attribute)

        def timed(*args, __original=original, __name=attribute, **kwargs):
            begin = time.perf_counter()
            try:
                return __original(*args, **kwargs)
            finally:
                phases.setdefault(__name, time.perf_counter() - begin)

        setattr(module, attribute, timed)


if __name__ == "__main__":
    main()
