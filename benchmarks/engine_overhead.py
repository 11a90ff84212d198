"""What the async engine costs: event-to-coroutine latency, and 64 streams vs the plain step loop.

1. Event latency: a kernel of known length is queued with an event behind it; a thread
   spinning on event.query() stamps the moment it completes, and the coroutine awaiting
   `wait_event` stamps the moment it resumes. p50 and p99 of the difference.
2. Async overhead: the same 64-request workload (Qwen3-0.6B shape, random weights) through
   the synchronous EngineCore.step() loop, and through 64 concurrent `engine.stream`
   consumers. Output tokens/s of both, and TTFT / TPOT of the streams.

    python benchmarks/engine_overhead.py            # GPU, uvloop
    python benchmarks/engine_overhead.py --smoke    # CPU, tiny shape
"""

from __future__ import annotations

import argparse
import gc
import threading
import time

import anyio
import torch

from common import Timer, percentile, random_workload, save, shaped_model, smollm2  # noqa: I001
from astream import Engine, EngineConfig, SamplingParams
from astream.core.engine_core import EngineCore
from astream.runtime.events import wait_event


async def event_latency(samples: int) -> dict:
    latencies = []
    for _ in range(samples):
        torch.cuda._sleep(200_000)                       # ~0.1 ms of device time
        event = torch.cuda.Event(blocking=True)
        event.record()
        stamp: list[float] = []

        def spin() -> None:
            while not event.query():
                pass
            stamp.append(time.perf_counter())

        spinner = threading.Thread(target=spin)
        spinner.start()
        await wait_event(event)
        resumed = time.perf_counter()
        spinner.join()
        latencies.append((resumed - stamp[0]) * 1e6)
    return {"samples": samples, "p50_us": round(percentile(latencies, 50), 1),
            "p99_us": round(percentile(latencies, 99), 1), "max_us": round(max(latencies), 1)}


def plain_loop(config: EngineConfig, work) -> dict:
    core = EngineCore.create(config)
    for i, (prompt, out) in enumerate(work):
        core.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True))
    produced = 0
    with Timer() as t:
        while core.scheduler.has_work():
            produced += core.step()
    core.runner.graphs = None
    del core
    return {"seconds": round(t.seconds, 3), "output_tokens": produced,
            "output_tok_s": round(produced / t.seconds, 1)}


async def streamed(config: EngineConfig, work) -> dict:
    ttft, tpot, produced = [], [], 0
    async with Engine(**{f: getattr(config, f) for f in config.__dataclass_fields__}) as engine:
        async def consume(i: int, prompt: list[int], out: int) -> None:
            nonlocal produced
            params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
            start, stamps = time.perf_counter(), []
            async for tok in engine.stream(prompt, params, request_id=f"s{i}"):
                stamps.append(time.perf_counter())
            produced += len(stamps)
            ttft.append((stamps[0] - start) * 1e3)
            if len(stamps) > 1:
                tpot.append((stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3)

        with Timer() as t:
            async with anyio.create_task_group() as group:
                for i, (prompt, out) in enumerate(work):
                    group.start_soon(consume, i, prompt, out)
    return {"seconds": round(t.seconds, 3), "output_tokens": produced,
            "output_tok_s": round(produced / t.seconds, 1),
            "ttft_ms_p50": round(percentile(ttft, 50), 1), "ttft_ms_p99": round(percentile(ttft, 99), 1),
            "tpot_ms_p50": round(percentile(tpot, 50), 2), "tpot_ms_p99": round(percentile(tpot, 99), 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokenizer", default=None, help="any tokenizer (prompts are random ids)")
    parser.add_argument("--name", default="engine_overhead", help="results file name")
    args = parser.parse_args()
    smoke = args.smoke
    folder = shaped_model("tiny" if smoke else "qwen3-0.6b", max_positions=4096)
    config = EngineConfig(model=str(folder), load_format="dummy", tokenizer=args.tokenizer or smollm2(),
                          device="cpu" if smoke else "cuda", dtype="float32" if smoke else "bfloat16",
                          max_num_seqs=args.streams, max_model_len=2048, gpu_memory_utilization=0.4)
    work = random_workload(8 if smoke else args.streams, 10 if smoke else 100, 40 if smoke else 1024,
                           5 if smoke else 128, 20 if smoke else 512, seed=1)
    result = {"workload": f"{len(work)} requests, in 100..1024, out 128..512, greedy, ignore_eos"}
    if not smoke:
        result["event_latency"] = anyio.run(event_latency, 300, backend_options={"use_uvloop": True})
    result["plain_step_loop"] = plain_loop(config, work)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()           # hand the first engine's cache back before the second sizes its own
    result["streams"] = anyio.run(streamed, config, work, backend_options={"use_uvloop": True})
    result["streams_vs_plain"] = round(result["streams"]["output_tok_s"] /
                                       result["plain_step_loop"]["output_tok_s"], 3)
    save(args.name, result, smoke=smoke)
    for key, value in result.items():
        print(f"{key:<18} {value}")


if __name__ == "__main__":
    main()
