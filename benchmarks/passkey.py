"""Passkey retrieval with a real long-context model, offload on and off: a thin call of astream.eval.

A 5-to-7-digit key is hidden at depths 0.1, 0.5 and 0.9 of a long haystack; the model
(Qwen2.5-Coder-0.5B-Instruct, 32K context, Q4_K_M GGUF) must repeat it. Both configurations
answer the same prompts; greedy answers with offload on and off must be identical.

    python benchmarks/passkey.py --model /tmp/qwen25coder05b.gguf        # GPU
    python benchmarks/passkey.py --smoke                                  # CPU, SmolLM2, short

The full grid, other policies and plots: `astream eval needle --compare full,offload ...`.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import anyio

from common import save, smollm2  # noqa: I001
from astream.eval import (NEEDLE, EvalPlan, format_summary, load_tokenizer, parse_configs, parse_depths,
                          run_eval, score, summary, trial_row)


def transformers_answers(model: str, tokenizer, trials) -> list[dict]:
    """transformers' greedy answers on exactly the prompt ids astream saw (the reference)."""
    import torch
    from transformers import AutoModelForCausalLM
    path = Path(model)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.bfloat16).to("cuda").eval()
    answers = []
    for trial in trials:
        ids = torch.tensor([trial.prompt_ids], device="cuda")
        with torch.no_grad():
            new = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=trial.max_tokens,
                              do_sample=False)[0, ids.shape[1]:]
        text = tokenizer.decode(new, skip_special_tokens=True)
        answers.append({"length": trial.length, "depth": trial.depth, "answer": text.strip(),
                        "found": score(text, trial.expected, trial.kind).correct})
        print("transformers", answers[-1])
    return answers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="/tmp/qwen25coder05b.gguf")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--transformers", action="store_true",
                        help="also answer each prompt with transformers (GPU only)")
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    args = parser.parse_args()
    if args.smoke:
        model, lengths = smollm2(), (600,)
        engine = dict(device="cpu", dtype="float32", kv_block_size=64, offload_slot_tokens=256)
    else:
        model, lengths, engine = args.model, (16384, 32000), dict(device="cuda", dtype="bfloat16")
    tokenizer = load_tokenizer(model)
    plan = EvalPlan((NEEDLE,), lengths, tuple(parse_depths(args.depths)), trials=1, seed=7)
    configs = parse_configs("full,offload")
    run = anyio.run(partial(run_eval, plan, model, configs, engine, tokenizer=tokenizer))
    rows = {name: [trial_row(r) for c in run.cells if c.config == name for r in c.results]
            for name in ("full", "offload")}
    same = [a["answer"] == b["answer"] for a, b in zip(rows["full"], rows["offload"])]
    results = {"resident": rows["full"], "offload": rows["offload"], "summary": summary(run.cells),
               "identical_answers": same}
    if args.transformers and not args.smoke:
        results["transformers"] = transformers_answers(model, tokenizer, run.trials)
    save("passkey", results, smoke=args.smoke)
    print(format_summary(run.cells))
    print("identical answers with offload:", results["identical_answers"])


if __name__ == "__main__":
    main()
