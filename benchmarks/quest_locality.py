"""How much of Quest's page selection carries over from one decode step to the next.

With offload, every page a step selects crosses PCIe, even a page the previous step read
too. This measures what a device-side cache of last step's pages could save: for each
decode step after the first, per layer and KV head, the share of the selected pages that
the same layer and head also selected one step before (the sink and recent pages are
included, as they are in what a step gathers).

One sequence, greedy, resident and eager (the selections are read after each step).
A real model reads a natural-text prompt (filler sentences, then a question about them);
a random-weight shape reads random tokens.

    python benchmarks/quest_locality.py --model /tmp/qwen25coder05b.gguf --ctx 16384,32000
    python benchmarks/quest_locality.py --model qwen3-4b --tokenizer DIR --ctx 32768
    python benchmarks/quest_locality.py --smoke                       # CPU, SmolLM2
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

from common import engine_core, save, shaped_model, smollm2  # noqa: I001
from astream.config import EngineConfig
from astream.core import EngineCore
from astream.eval.filler import filler_sentences
from astream.policies import QuestPolicy
from astream.policies.quest import QuestRuntime
from astream.sampling import SamplingParams


def natural_prompt(core: EngineCore, tokens: int, seed: int) -> list[int]:
    """Filler sentences up to about `tokens` tokens, then a question, as a chat turn."""
    rng = random.Random(seed)
    encode = core.tokenizer.encode
    ids: list[int] = []
    while len(ids) < tokens - 64:
        ids += encode(" ".join(filler_sentences(rng, 200)) + " ", add_special_tokens=False)
    question = encode(" Which of the sentences above is the most surprising, and why?",
                      add_special_tokens=False)
    return ids[: tokens - 64] + question


def record_selections(log: list) -> None:
    """Wrap QuestRuntime.select_decode so each call's (layer, page sets) lands in `log`."""
    original = QuestRuntime.select_decode

    def recorded(self, layer, query):
        chosen = original(self, layer, query)
        indices, counts = chosen.indices.cpu(), chosen.counts.cpu()
        heads = [set(indices[0, h, : int(counts[0, h])].tolist()) for h in range(indices.shape[1])]
        log.append((layer, heads))
        return chosen

    QuestRuntime.select_decode = recorded


def carried_over(steps: list[dict]) -> list[float]:
    """Per step after the first: the share of its picks also picked the step before."""
    shares = []
    for before, now in zip(steps, steps[1:]):
        kept = picked = 0
        for layer, heads in now.items():
            for head, pages in enumerate(heads):
                kept += len(pages & before[layer][head]) if layer in before else 0
                picked += len(pages)
        shares.append(kept / max(picked, 1))
    return shares


def one_context(core: EngineCore, log: list, ctx: int, steps: int, natural: bool, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    prompt = (natural_prompt(core, ctx, seed) if natural
              else torch.randint(100, 49152, (ctx,), generator=gen).tolist())
    sink = core.add_request(f"r{ctx}", prompt, SamplingParams(temperature=0.0, max_tokens=steps + 1,
                                                              ignore_eos=True))
    while not sink.tokens:
        core.step()
    log.clear()
    per_step = []
    while not sink.tokens[-1].finish_reason:
        core.step()
        if log:
            per_step.append(dict(log))
            log.clear()
    shares = carried_over(per_step) or [float("nan")]    # nan: fewer than two selecting steps
    row = {"context": len(prompt), "steps": len(per_step), "carried_over_mean": round(statistics.mean(shares), 3),
           "carried_over_min": round(min(shares), 3), "carried_over_max": round(max(shares), 3),
           "text": "".join(tok.text for tok in sink.tokens)[:200] if natural else None}
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a GGUF/folder, or a shape name (random weights)")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--ctx", default="16384")
    parser.add_argument("--budgets", default="1024,2048,4096")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--name", default="quest_locality")
    args = parser.parse_args()
    contexts = [int(c) for c in args.ctx.split(",")]
    shape = args.model if args.model and not args.model.endswith(".gguf") and "/" not in args.model else None
    natural = shape is None
    if args.smoke:
        model, device, dtype, contexts, budgets = smollm2(), "cpu", "float32", [600], [128]
    else:
        model = str(shaped_model(shape, max_positions=max(contexts) + args.steps + 8)) if shape else args.model
        device, dtype, budgets = "cuda", "bfloat16", [int(b) for b in args.budgets.split(",")]
    log: list = []
    record_selections(log)
    rows = []
    for budget in budgets:
        config = EngineConfig(model=model, tokenizer=args.tokenizer or (None if natural else smollm2()),
                              load_format="dummy" if shape else "auto", device=device, dtype=dtype,
                              max_model_len=max(contexts) + args.steps + 8, enforce_eager=True,
                              max_num_seqs=4, max_num_batched_tokens=8192,
                              sparse_policy=QuestPolicy(budget_tokens=budget,
                                                        dense_layers=0 if args.smoke else 2))
        with engine_core(config) as core:
            for ctx in contexts:
                rows.append({"budget": budget, **one_context(core, log, ctx, 6 if args.smoke else args.steps,
                                                             natural, seed=ctx)})
        del core                # so the next engine_core() can hand its memory back
    save(args.name, {"model": args.model or "smollm2", "rows": rows}, smoke=args.smoke)


if __name__ == "__main__":
    main()
