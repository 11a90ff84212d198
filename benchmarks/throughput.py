"""Offline throughput: 256 requests, input and output lengths uniform in 100..1024.

Qwen3-0.6B- and Qwen3-4B-shaped models with random weights, bf16, greedy with
ignore_eos so every request produces exactly its output length. In the same run,
transformers' `generate` (batched, left-padded) on a subset of the workload with
outputs capped, next to astream on that same subset: generating the full workload
through transformers would take several minutes of the GPU budget.

    python benchmarks/throughput.py              # GPU
    python benchmarks/throughput.py --smoke      # CPU, tiny shape
    python benchmarks/throughput.py --shapes qwen3-0.6b --repeat 5 --step-cadence
        # per run: step intervals, steps with prompt chunks apart, the longest steps
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time

import torch

from common import Timer, percentile, random_workload, save, shaped_model, smollm2  # noqa: I001
from astream import LLM, SamplingParams
from astream.core.engine_core import EngineCore


class StepCadence:
    """When each step's results reach the host (`EngineCore.process`, wrapped for the run):
    where a slower run spends its extra time, in every step or in a few stalls."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.prefill_tokens: list[int] = []      # per step: tokens of prompt chunks in it
        self.rows: list[int] = []                # per step: sequences in it
        self.collections: list[tuple[int, float]] = []   # Python's GC: (generation, ms)
        self._gc_start = 0.0
        self.process = EngineCore.process

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.collections.append((info["generation"], (time.perf_counter() - self._gc_start) * 1e3))

    def __enter__(self) -> "StepCadence":
        process, times = self.process, self.times

        def timed(core, output):
            delivered = process(core, output)
            times.append(time.perf_counter())
            items = output.batch.items
            self.prefill_tokens.append(sum(i.num_tokens for i in items if i.num_tokens > 1))
            self.rows.append(len(items))
            return delivered

        EngineCore.process = timed
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc) -> None:
        EngineCore.process = self.process
        gc.callbacks.remove(self._on_gc)

    def summary(self) -> dict:
        gaps = [(b - a) * 1e3 for a, b in zip(self.times, self.times[1:])]
        if not gaps:
            return {}
        median = percentile(gaps, 50)
        stalls = [g for g in gaps if g > 3 * median]
        # Gap i ends with step i + 1's results: split the time by what that step held.
        prefill = [g for g, n in zip(gaps, self.prefill_tokens[1:]) if n]
        longest = sorted(zip(gaps, self.prefill_tokens[1:], self.rows[1:]), reverse=True)[:8]
        return {"step_ms_p50": round(median, 3), "step_ms_p90": round(percentile(gaps, 90), 3),
                "step_ms_p99": round(percentile(gaps, 99), 3), "step_ms_max": round(max(gaps), 3),
                "stalls_over_3x_median": len(stalls), "stall_ms_total": round(sum(stalls), 1),
                "step_ms_total": round(sum(gaps), 1),
                "prefill_steps": len(prefill), "prefill_step_ms_total": round(sum(prefill), 1),
                "decode_step_ms_total": round(sum(gaps) - sum(prefill), 1),
                "longest_steps_ms_prefill_rows": [(round(g, 1), n, r) for g, n, r in longest],
                "gc_collections_by_generation": [sum(1 for g, _ in self.collections if g == gen)
                                                 for gen in range(3)],
                "gc_ms_total": round(sum(ms for _, ms in self.collections), 1),
                "gc_ms_max": round(max((ms for _, ms in self.collections), default=0.0), 1)}


def astream_run(llm: LLM, work: list[tuple[list[int], int]], cadence: bool = False) -> dict:
    params = [SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True) for _, out in work]
    before = llm.stats()
    clock = StepCadence()
    with Timer() as t, (clock if cadence else contextlib.nullcontext()):
        outs = llm.generate([prompt for prompt, _ in work], params)
    after = llm.stats()
    produced = sum(len(o.token_ids) for o in outs)
    assert produced == sum(out for _, out in work), "a request stopped early"
    prompt_tokens = sum(len(p) for p, _ in work)
    return {"requests": len(work), "seconds": round(t.seconds, 3), "output_tokens": produced,
            "output_tok_s": round(produced / t.seconds, 1),
            "total_tok_s": round((produced + prompt_tokens) / t.seconds, 1),
            "steps": after["steps"] - before["steps"],
            "prefix_cache_hits": after["prefix_cache_hits"] - before["prefix_cache_hits"],
            "preemptions": after["preemptions"] - before["preemptions"], **clock.summary()}


def spread(values: list[float]) -> dict:
    """min / median / max of repeated runs."""
    ordered = sorted(values)
    return {"min": ordered[0], "median": ordered[len(ordered) // 2], "max": ordered[-1]}


def hf_run(folder, work: list[tuple[list[int], int]], device: str) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(folder)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    width = max(len(p) for p, _ in work)
    ids = torch.zeros(len(work), width, dtype=torch.long)
    mask = torch.zeros(len(work), width, dtype=torch.long)
    for row, (prompt, _) in enumerate(work):             # left padding
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    max_new = max(out for _, out in work)
    with torch.no_grad(), Timer() as t:
        out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new,
                             min_new_tokens=max_new, do_sample=False, pad_token_id=0)
    generated = out.shape[1] - width
    useful = sum(min(n, generated) for _, n in work)
    del model
    return {"requests": len(work), "seconds": round(t.seconds, 3), "useful_output_tokens": useful,
            "useful_output_tok_s": round(useful / t.seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--shapes", default="qwen3-0.6b,qwen3-4b")
    parser.add_argument("--num", type=int, default=256)
    parser.add_argument("--subset", type=int, default=16)
    parser.add_argument("--subset-max-out", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=1, help="runs of the workload on one engine")
    parser.add_argument("--warmup-runs", type=int, default=0,
                        help="untimed runs of the workload first (prefill plans, the prefix cache)")
    parser.add_argument("--fresh-prompts", action="store_true",
                        help="new random prompts every run (the prefix cache cannot serve a repeat)")
    parser.add_argument("--skip-hf", action="store_true", help="no transformers subset")
    parser.add_argument("--step-cadence", action="store_true",
                        help="per run, the intervals between steps' results (median, tail, stalls)")
    parser.add_argument("--name", default="throughput", help="results file name")
    parser.add_argument("--tokenizer", default=None, help="any tokenizer (prompts are random ids)")
    parser.add_argument("--kv-dtypes", default="auto",
                        help="KV cache dtypes to run in turn (rows shape@dtype), e.g. auto,fp8_e4m3")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    shapes = ["tiny"] if args.smoke else args.shapes.split(",")
    num = 8 if args.smoke else args.num
    work = random_workload(num, 100, 1024, 100, 1024) if not args.smoke else \
        random_workload(num, 10, 40, 5, 20)
    subset = [(p, min(o, args.subset_max_out)) for p, o in work[:args.subset if not args.smoke else 4]]
    results = {}
    kv_dtypes = args.kv_dtypes.split(",")
    for shape, kv in ((shape, kv) for shape in shapes for kv in kv_dtypes):
        folder = shaped_model(shape, max_positions=4096)
        kw = dict(load_format="dummy", tokenizer=args.tokenizer or smollm2(), device=device,
                  dtype="bfloat16" if not args.smoke else "float32",
                  max_num_seqs=256, max_model_len=2112, kv_cache_dtype=kv)
        key = shape if len(kv_dtypes) == 1 else f"{shape}@{kv}"
        with LLM(str(folder), **kw) as llm:
            llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=8, ignore_eos=True))   # warm-up
            warmups = [astream_run(llm, random_workload(num, 100, 1024, 100, 1024, seed=1000 + w)
                                   if args.fresh_prompts and not args.smoke else work)["output_tok_s"]
                       for w in range(args.warmup_runs)]   # fresh: not the timed runs' prompts
            runs = [astream_run(llm, random_workload(num, 100, 1024, 100, 1024, seed=rep)
                                if args.fresh_prompts and rep and not args.smoke else work,
                                cadence=args.step_cadence)
                    for rep in range(args.repeat)]
            results[key] = {"astream": runs[len(runs) // 2] if args.repeat == 1 else
                            {**spread([r["output_tok_s"] for r in runs]), "runs": runs},
                            "astream_subset": astream_run(llm, subset),
                            "kv_blocks": llm.stats()["kv_blocks_total"],
                            "untimed_warmup_tok_s": warmups}
            if args.repeat > 1:
                results[key]["astream"]["output_tok_s"] = results[key]["astream"]["median"]
        gc.collect()
        if shape in ("qwen3-0.6b", "tiny") and not args.skip_hf and kv == kv_dtypes[0]:
            results[key]["transformers_subset"] = hf_run(folder, subset, device)
        if device == "cuda":
            torch.cuda.empty_cache()
        print(key, results[key])
    save(args.name, {"workload": f"{num} requests, in/out uniform 100..1024, greedy, ignore_eos",
                        "subset": f"first {len(subset)} requests, outputs capped at "
                                  f"{args.subset_max_out}", **results}, smoke=args.smoke)
    print(f"{'shape':<12} {'astream out tok/s':>18} {'subset astream':>15} {'subset HF':>10}")
    for shape, r in results.items():
        hf = r.get("transformers_subset", {}).get("useful_output_tok_s", "-")
        print(f"{shape:<12} {r['astream']['output_tok_s']:>18} {r['astream_subset']['output_tok_s']:>15} "
              f"{hf:>10}")


if __name__ == "__main__":
    main()
