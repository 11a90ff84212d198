"""GPU check of the sampling tail (executor.sampling_tail) on fresh random logits: its CUDA
graphs against the eager sampler (`sample` + `compute_logprobs`), the pool memory the tails
keep, and one step's sampling timed both ways; then the embedded model's engine, decode
graphs against enforce_eager, with rows that need the tail (resident and offloaded).

Per batch size (rows, padded to the captured size as the engine pads):
- greedy rows with penalties, min_tokens bans, pending tokens and logprobs: the same ids and
  logprobs as the eager sampler, exactly;
- sampled rows with top-k, top-p and penalties, the batch filling its size: from the same
  generator state, the very draws of the eager sampler; with padding, every id obeys top-k
  and the bans;
- time of a step's sampling: eager (what the host launched before) against the tables'
  fill and the tail's replay, on the device (CUDA events) and host launch time.

    python benchmarks/graph_sampling_check.py [--rows 1 8 64] [--vocab 151936] [--no-engine]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time

import torch

from common import smollm2  # noqa: I001  (sets sys.path)
from astream import LLM, SamplingParams
from astream.base.sampling import SamplingParams as Params
from astream.core.sequence import Sequence
from astream.executor.cuda_graphs import capture_sizes, padded_size
from astream.executor.logprobs import compute_logprobs
from astream.executor.penalties import build_processing, process_logits
from astream.executor.sampler import SamplingBatch, sample
from astream.executor.sampling_tail import SamplingTables, tail_mode, tail_modes
from astream.kvcache.sizing import SAMPLING_WORKSPACE_BYTES

EOS = frozenset({2})
LOGPROBS = 5


def make_batch(n: int, vocab: int, device: torch.device, sampled: bool, rng: random.Random
               ) -> tuple[SamplingBatch, torch.Tensor]:
    """n rows, each with a few hundred output tokens and a prompt: penalties, bans, pending
    tokens; `sampled`: temperatures with top-k and top-p."""
    rows, temps, top_k, top_p = [], [], [], []
    for i in range(n):
        kind = i % 4
        params = Params(temperature=0.0,
                        frequency_penalty=0.8 if kind == 0 else 0.0, presence_penalty=0.5 if kind == 0 else 0.0,
                        repetition_penalty=1.3 if kind == 1 else 1.0,
                        min_tokens=1000 if kind == 2 else 0, max_tokens=2000, stop_token_ids=[5, 6] if kind == 2 else ())
        seq = Sequence("r", [rng.randrange(vocab) for _ in range(1000)], params, 0,
                       output_token_ids=[rng.randrange(vocab) for _ in range(300)])
        if kind < 2:
            seq.num_pending, seq.pending_row = 1, i
        rows.append(seq)
        temps.append(rng.uniform(0.7, 1.3) if sampled and kind != 3 else (1.0 if sampled else 0.0))
        top_k.append(50 if i % 3 == 0 else vocab)
        top_p.append(0.9 if i % 3 == 1 else 1.0)
    processing = build_processing(rows, vocab, device, EOS)
    t = torch.tensor(temps, device=device)
    batch = SamplingBatch(t, torch.tensor(top_k, device=device) if sampled else None,
                          torch.tensor(top_p, device=device) if sampled else None, not sampled, [],
                          processing, LOGPROBS)
    previous_ids = torch.randint(0, vocab, (n,), device=device)
    return batch, previous_ids


class TailGraph:
    """One tail captured for `size` rows over its own tables, as the engine captures it."""

    def __init__(self, size: int, vocab: int, batch: SamplingBatch, previous_ids, generator, pool):
        device = previous_ids.device
        self.size, self.n, self.batch, self.previous = size, batch.temperatures.shape[0], batch, previous_ids
        self.tables = SamplingTables.allocate(size, vocab, device)
        self.temps = torch.ones(size, device=device)
        self.ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.tail = tail_mode(batch)
        self.generator = generator
        self.fill()
        self.ids[:size] = self.tables.program(size, self.tail, self.temps, generator)   # warm-up
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        if self.tail.draw:
            self.graph.register_generator_state(generator)
        with torch.cuda.graph(self.graph, pool=pool):
            self.ids[:size] = self.tables.program(size, self.tail, self.temps, generator)

    def fill(self) -> None:
        self.temps[:self.n].copy_(self.batch.temperatures)
        self.temps[self.n:self.size].fill_(1.0)
        self.tables.fill(self.batch, self.n, self.size, self.tail, self.previous)

    def step(self) -> torch.Tensor:
        self.fill()
        self.graph.replay()
        return self.ids[:self.n]


def eager_step(logits: torch.Tensor, batch: SamplingBatch, previous_ids, generator):
    ids = sample(logits, batch, generator, previous_ids)
    return ids, compute_logprobs(logits, ids, LOGPROBS)


def check_size(n: int, vocab: int, rng: random.Random, iters: int) -> dict:
    device = torch.device("cuda")
    size = padded_size(capture_sizes(256), n)
    generator = torch.Generator(device=device)
    generator.manual_seed(0)
    result = {"rows": n, "captured_size": size}
    for sampled in (False, True):
        batch, previous = make_batch(n, vocab, device, sampled, rng)
        pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        tail = TailGraph(size, vocab, batch, previous, generator, pool)
        pool_bytes = torch.cuda.memory_reserved() - reserved - sum(t.nbytes for t in tail.tables.vocab_tables)
        name = "sampled" if sampled else "greedy"
        logits = torch.randn(size, vocab, device=device) * 4
        tail.tables.logits.copy_(logits)
        state = generator.get_state()
        got = tail.step().clone()
        got_lp = tail.tables.logprobs(n)
        generator.set_state(state)
        want, want_lp = eager_step(logits[:n], batch, previous, generator)
        entry = {"tail": str(tail.tail), "pool_bytes_per_row_token": round(pool_bytes / (size * vocab), 2),
                 "same_ids": int((got == want).sum()), "of": n}
        if not sampled:
            entry["logprobs_equal"] = bool(torch.equal(got_lp.chosen, want_lp.chosen)
                                           and torch.equal(got_lp.top_ids[:, :LOGPROBS], want_lp.top_ids))
            entry["logprobs_max_abs_diff"] = float((got_lp.top_values[:, :LOGPROBS] - want_lp.top_values).abs().max())
        else:
            entry["draws_identical"] = n == size and bool(torch.equal(got, want))
            # Top-k cuts the processed logits (a temperature keeps their order).
            processed = process_logits(logits[:n], batch.processing, previous)
            chosen = processed.gather(1, got.unsqueeze(1))
            chosen_rank = (processed > chosen).sum(dim=-1)
            entry["top_k_held"] = bool((chosen_rank < batch.top_k).all())
            banned = batch.processing.banned
            entry["bans_held"] = banned is None or not bool((got[banned[0]] == banned[1]).any())
        entry.update(time_both(tail, logits[:n].clone(), batch, previous, generator, iters))
        result[name] = entry
    return result


def time_both(tail: TailGraph, logits: torch.Tensor, batch, previous, generator, iters: int) -> dict:
    """Per step: device time (CUDA events over `iters` steps back to back) and host time to
    launch, for the eager sampler and for fill + replay."""
    out = {}
    for name, step in (("eager", lambda: eager_step(logits, batch, previous, generator)), ("graph", tail.step)):
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        host = time.perf_counter()
        start.record()
        for _ in range(iters):
            step()
        end.record()
        host = time.perf_counter() - host
        torch.cuda.synchronize()
        out[f"{name}_ms"] = round(start.elapsed_time(end) / iters, 4)
        out[f"{name}_host_launch_ms"] = round(host * 1e3 / iters, 4)
    return out


def engine_check(offload: bool) -> dict:
    """Greedy rows with penalties, bans and logprobs, and sampled rows with top-k/top-p: the
    graphs sample them in the tail (`sampled_inside` counts every graph step); greedy tokens
    against enforce_eager (bf16: a graph's padded batch may round a near tie differently)."""
    # The engines before this one in the process (and what still referred to them) gave
    # their memory back to torch's cache: give it to the driver, where engines size from.
    gc.collect()
    torch.cuda.empty_cache()
    prompts = ["The quick brown fox", "def fibonacci(n):", "1, 2, 3, 4,", "Write a haiku about the sea."]
    params = [SamplingParams(temperature=0, max_tokens=32, frequency_penalty=1.0, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=32, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=32, min_tokens=32, presence_penalty=1.0, logprobs=0),
              SamplingParams(temperature=0, max_tokens=32, logprobs=5, ignore_eos=True)]
    options = dict(dtype="bfloat16", max_model_len=1024, max_num_seqs=8)
    if offload:
        options.update(offload=True, kv_block_size=16)
    with LLM(smollm2(), **options, enforce_eager=True) as llm:
        want = llm.generate(prompts, params)
    with LLM(smollm2(), **options) as llm:
        graphs = llm.core.runner.graphs
        got = llm.generate(prompts, params)
        steps, inside = graphs.steps, graphs.sampler.sampled_inside
        sampled = llm.generate(prompts, SamplingParams(temperature=0.9, top_k=40, top_p=0.9, max_tokens=32,
                                                       ignore_eos=True, presence_penalty=0.5))
        sampled_inside = graphs.sampler.sampled_inside - inside
    diffs = [abs(a.logprob - b.logprob) for g, w in zip(got, want)
             for a, b in zip(g.logprobs or (), w.logprobs or ()) if a.token_id == b.token_id]
    return {"graph_steps": steps, "sampled_inside": inside,
            "same_tokens": sum(g.token_ids == w.token_ids for g, w in zip(got, want)), "of": len(prompts),
            "logprob_max_abs_diff": max(diffs) if diffs else None,
            "sampled_steps_inside": sampled_inside,
            "sampled_lengths_ok": all(len(o.token_ids) == 32 for o in sampled)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 8, 64, 256],
                        help="batch sizes of the sampling checks (none: the engine checks only)")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--no-engine", action="store_true")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "a GPU check"
    print(json.dumps({"tails_per_size": len(tail_modes(True)),
                      "planned_workspace_bytes_per_row_token": SAMPLING_WORKSPACE_BYTES}), flush=True)
    rng = random.Random(0)
    for n in args.rows:
        print(json.dumps(check_size(n, args.vocab, rng, args.iters)), flush=True)
    if not args.no_engine:
        for offload in (False, True):
            print(json.dumps({"engine": "offload" if offload else "resident", **engine_check(offload)}),
                  flush=True)


if __name__ == "__main__":
    main()
