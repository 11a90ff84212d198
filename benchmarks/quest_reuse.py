"""Quest with offload on a real model: decode steps with and without `reuse_pages`.

A random-weight shape (benchmarks/quest.py) picks pages with little overlap from one step
to the next; a real model reading natural text keeps most of them (quest_locality.py), and
that is what `reuse_pages` is for. Here one real model reads a natural-text prompt with
the KV cache offloaded; each run builds a fresh engine, prefills, then times decode steps
(synchronous and pipelined, as in quest.py) and counts the pages read and loaded per step.
Variants alternate, so each repeat measures both on the same machine state.

    python benchmarks/quest_reuse.py --model /tmp/qwen25coder05b.gguf --ctx 32000 --budget 4096
    python benchmarks/quest_reuse.py --smoke            # CPU, SmolLM2: checks the script
"""

from __future__ import annotations

import argparse

from common import engine_core, save, smollm2  # noqa: I001
from quest import decode_steps, pipelined_steps, spread
from quest_locality import natural_prompt
from astream.config import EngineConfig
from astream.policies import QuestPolicy
from astream.sampling import SamplingParams


def one_run(config: EngineConfig, ctx: int, steps: int) -> dict:
    with engine_core(config) as core:
        prompt = natural_prompt(core, ctx, seed=ctx)
        params = SamplingParams(temperature=0.0, max_tokens=4 * steps + 8, ignore_eos=True)
        sink = core.add_request("r", prompt, params)
        while not sink.tokens:
            core.step()
        decode_steps(core, 2)                                    # warm-up
        before = core.stats()
        times = decode_steps(core, steps)
        after = core.stats()
        pipelined = pipelined_steps(core, steps)
        per_step = {key: (sum(after[key]) - sum(before[key])) / steps
                    for key in ("quest_pages_read", "quest_pages_loaded")}
        return {"context": len(prompt), **spread("step_ms", times),
                **spread("pipelined_step_ms", pipelined),
                "pages_read_per_step": round(per_step["quest_pages_read"], 1),
                "pages_loaded_per_step": round(per_step["quest_pages_loaded"], 1),
                "text": "".join(tok.text for tok in sink.tokens)[:120]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a GGUF file or model folder")
    parser.add_argument("--ctx", type=int, default=32000)
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--name", default="quest_reuse")
    args = parser.parse_args()
    if args.smoke:
        model, device, dtype, ctx, budget, steps, repeat = smollm2(), "cpu", "float32", 600, 64, 4, 1
    else:
        model, device, dtype = args.model, "cuda", "bfloat16"
        ctx, budget, steps, repeat = args.ctx, args.budget, args.steps, args.repeat
    rows = []
    for run in range(repeat):
        for reuse in (False, True):
            config = EngineConfig(
                model=model, device=device, dtype=dtype, offload=True, max_num_seqs=1,
                max_model_len=ctx + 4 * steps + 64, max_num_batched_tokens=8192,
                sparse_policy=QuestPolicy(budget_tokens=budget, dense_layers=0 if args.smoke else 2,
                                          reuse_pages=reuse))
            rows.append({"run": run, "reuse_pages": reuse, "budget": budget,
                         **one_run(config, ctx, steps)})
            print(rows[-1], flush=True)
    save(args.name, {"model": model, "rows": rows}, smoke=args.smoke)
    print(f"{'reuse':>6}{'sync ms (min/med/max)':>24}{'pipelined ms':>22}{'pages read':>12}{'loaded':>9}")
    for r in rows:
        sync = f"{r['step_ms_min']}/{r['step_ms']}/{r['step_ms_max']}"
        pipelined = f"{r['pipelined_step_ms_min']}/{r['pipelined_step_ms']}/{r['pipelined_step_ms_max']}"
        print(f"{str(r['reuse_pages']):>6}{sync:>24}{pipelined:>22}"
              f"{r['pages_read_per_step']:>12}{r['pages_loaded_per_step']:>9}")


if __name__ == "__main__":
    main()
