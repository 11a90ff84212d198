"""Host time of a decode step at large batch, on the CPU, with the device work removed.

The engine runs a micro model (one layer, hidden 64, random weights, the SmolLM2
tokenizer's vocabulary), and by default its step program is replaced by one that only
draws random token ids for the sampled rows (`--device-work none`): what is left is
the host's share of a step, as on a GPU, with the CPU's caches not flushed by a CPU
forward pass in between. `--device-work model` runs the micro model's forward instead.
Prompts are 100..1024 random tokens, so block tables are as wide as in
benchmarks/throughput.py; every sequence is decoding while it is measured.

1. Core phases: EngineCore driven step by step, each request's output going to the
   engine's own request channel (nobody reads it). Per step: schedule, prepare (step
   inputs and sampling batch), process (token bookkeeping, detokenization, stop checks,
   delivery) and, within process, emit (the time inside the channels). `forward` is
   the step program: device work on a GPU. The garbage collector is off while steps
   are timed: the unread channels keep every token alive, which no consumer would.
2. Async loop: Engine.stream with one consumer per request; CPU time of the event-loop
   thread per decode step (on the CPU the step program runs on a worker thread and is
   not counted).

Each figure is min / median / max over --runs runs.

    python benchmarks/host_step.py                  # batches 64 and 256, 3 runs
    python benchmarks/host_step.py --smoke          # a quick check of the script
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time

import anyio
import torch

from common import random_workload, save, shaped_model, smollm2  # noqa: I001
from astream import Engine, EngineConfig, SamplingParams
from astream.core.engine_core import EngineCore, StepOutput
from astream.executor.runner import ModelRunner
from astream.stages.channel import RequestChannel

VOCAB = 8192                           # ids the SmolLM2 tokenizer decodes; a cheap logits matmul
PHASES = ("schedule", "prepare", "process", "emit", "forward")


class TimedSink:
    """A request channel whose delivery time adds up in `clock[0]`."""

    __slots__ = ("inner", "clock")

    def __init__(self, inner: RequestChannel, clock: list[float]) -> None:
        self.inner, self.clock = inner, clock

    def token(self, request, *args, **kwargs) -> bool:
        start = time.perf_counter()
        delivered = self.inner.token(request, *args, **kwargs)
        self.clock[0] += time.perf_counter() - start
        return delivered

    def progress(self, request, prefilled: int, total: int) -> None:
        self.inner.progress(request, prefilled, total)

    def reject(self, request, error: Exception) -> None:
        self.inner.reject(request, error)

    @property
    def backlog(self) -> int:
        return self.inner.backlog


@contextlib.contextmanager
def without_device_work(seed: int = 0):
    """ModelRunner.program replaced, while inside, by random ids for the sampled rows."""
    generator, real = torch.Generator().manual_seed(seed), ModelRunner.program

    def program(runner: ModelRunner, step, previous):
        yield from ()
        ids = torch.randint(100, VOCAB, (len(step.sampled),), generator=generator)
        host, ready = runner.runtime.to_host(ids)
        return StepOutput(step.batch, step.sampled, ids, host, ready)

    ModelRunner.program = program
    try:
        yield
    finally:
        ModelRunner.program = real


def engine_config(batch: int) -> dict:
    folder = shaped_model("micro", max_positions=4096, vocab_size=VOCAB)
    return dict(model=str(folder), load_format="dummy", tokenizer=smollm2(), device="cpu",
                dtype="float32", max_num_seqs=batch, max_model_len=2112,
                max_num_batched_tokens=16384, stream_buffer_tokens=1 << 20)


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def core_phases(batch: int, steps: int, warmup: int) -> dict[str, float]:
    """ms per decode step of each phase of the synchronous core."""
    core = EngineCore.create(EngineConfig(**engine_config(batch)))
    clock = [0.0]
    for i, (prompt, _) in enumerate(random_workload(batch, 100, 1024, 1, 1, seed=batch, vocab=VOCAB)):
        request = core.open_request(f"r{i}", params(warmup + steps + 64),
                                    TimedSink(RequestChannel(), clock))
        core.admit(request, prompt)
    decoding = 0
    while decoding < warmup:           # prefill, then a few decode steps
        batch_now = core.schedule()
        core.process(core.launch(core.prepare(batch_now)))
        decoding = decoding + 1 if batch_now.num_tokens == len(batch_now.items) else 0
    clock[0] = 0.0
    gc.collect()
    gc.disable()
    try:
        totals = timed_steps(core, steps, batch)
    finally:
        gc.enable()
    totals["emit"] = clock[0]
    core.close()
    return {name: totals[name] * 1e3 / steps for name in PHASES}


def timed_steps(core: EngineCore, steps: int, batch: int) -> dict[str, float]:
    totals = dict.fromkeys(PHASES, 0.0)
    for _ in range(steps):
        t0 = time.perf_counter()
        scheduled = core.schedule()
        t1 = time.perf_counter()
        step = core.prepare(scheduled)
        t2 = time.perf_counter()
        output = core.launch(step)
        t3 = time.perf_counter()
        core.process(output)
        t4 = time.perf_counter()
        assert len(scheduled.items) == batch and scheduled.num_tokens == batch
        for name, seconds in zip(("schedule", "prepare", "forward", "process"),
                                 (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            totals[name] += seconds
    return totals


async def loop_cpu(batch: int, steps: int, warmup: int) -> float:
    """CPU ms of the event-loop thread per decode step, `batch` streams decoding."""
    work = random_workload(batch, 100, 1024, 1, 1, seed=batch, vocab=VOCAB)
    measured: list[float] = []
    async with Engine(**engine_config(batch)) as engine:
        scheduler = engine.core.scheduler

        async def consume(i: int, prompt: list[int]) -> None:
            async for _ in engine.stream(prompt, params(warmup + steps + 64), request_id=f"s{i}"):
                pass

        async def watch() -> None:
            while len(scheduler.running) < batch or scheduler.waiting:
                await anyio.sleep(0.005)
            await _until_step(scheduler, scheduler.steps + warmup)
            first, cpu = scheduler.steps, time.thread_time()
            await _until_step(scheduler, first + steps)
            measured.append((time.thread_time() - cpu) * 1e3 / (scheduler.steps - first))
            group.cancel_scope.cancel()

        async with anyio.create_task_group() as group:
            for i, (prompt, _) in enumerate(work):
                group.start_soon(consume, i, prompt)
            group.start_soon(watch)
    return measured[0]


async def _until_step(scheduler, step: int) -> None:
    while scheduler.steps < step:
        await anyio.sleep(0.02)


def spread(values: list[float]) -> dict:
    return {"min": round(min(values), 3), "median": round(statistics.median(values), 3),
            "max": round(max(values), 3)}


def measure(batch: int, runs: int, steps: int, warmup: int) -> dict:
    phases = [core_phases(batch, steps, warmup) for _ in range(runs)]
    loop = [anyio.run(loop_cpu, batch, steps, warmup, backend_options={"use_uvloop": True})
            for _ in range(runs)]
    result = {f"core_{name}_ms": spread([p[name] for p in phases]) for name in PHASES}
    result["core_host_ms"] = spread([p["schedule"] + p["prepare"] + p["process"] for p in phases])
    result["loop_cpu_ms"] = spread(loop)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100, help="decode steps measured per run")
    parser.add_argument("--warmup", type=int, default=8, help="decode steps before measuring")
    parser.add_argument("--device-work", choices=("none", "model"), default="none",
                        help="none: random ids stand in for each step's program; model: the "
                             "micro model's CPU forward")
    parser.add_argument("--name", default="host_step", help="results file name")
    args = parser.parse_args()
    torch.set_num_threads(1)           # keep any forward off the loop's core
    batches = [8] if args.smoke else [int(b) for b in args.batches.split(",")]
    runs, steps = (1, 5) if args.smoke else (args.runs, args.steps)
    results = {}
    with without_device_work() if args.device_work == "none" else contextlib.nullcontext():
        for batch in batches:
            results[f"batch_{batch}"] = measure(batch, runs, steps, 2 if args.smoke else args.warmup)
            print(f"batch {batch}:")
            for key, value in results[f"batch_{batch}"].items():
                print(f"  {key:<22} {value}")
    save(args.name, {"what": "host ms per decode step (CPU, micro model, greedy, ignore_eos, "
                             f"device work: {args.device_work}); {steps} steps per run, "
                             f"min/median/max of {runs} runs", **results}, smoke=args.smoke)


if __name__ == "__main__":
    main()
