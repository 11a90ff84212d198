"""Passkey retrieval with a real long-context model, offload on and off.

A 5-digit key is hidden at depths 0.1, 0.5 and 0.9 of a long filler prompt; the model
(Qwen2.5-Coder-0.5B-Instruct, 32K context, Q4_K_M GGUF) must repeat it. Greedy answers
with offload on and off must be identical.

    python benchmarks/passkey.py --model /tmp/qwen25coder05b.gguf        # GPU
    python benchmarks/passkey.py --smoke                                  # CPU, SmolLM2, short
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from common import save, smollm2  # noqa: I001
from astream import LLM, SamplingParams

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")


def build_prompt(tokenizer, target_tokens: int, depth: float, key: int) -> list[dict]:
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    filler_tokens = len(tokenizer(FILLER, add_special_tokens=False)["input_ids"])
    repeats = max(1, (target_tokens - 120) // filler_tokens)
    chunks = [FILLER] * repeats
    chunks.insert(int(depth * repeats), needle)
    text = ("There is an important pass key hidden inside a lot of irrelevant text. "
            "Find it and memorize it.\n" + "".join(chunks) +
            "\nWhat is the pass key? Answer with the number only.")
    return [{"role": "user", "content": text}]


def run(llm: LLM, lengths: list[int], depths: list[float], seed: int) -> list[dict]:
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    rows = []
    for length in lengths:
        for depth in depths:
            key = rng.randint(10000, 99999)
            prompt = build_prompt(llm.tokenizer, length, depth, key)
            start = time.perf_counter()
            out = llm.generate([prompt], params)[0]
            rows.append({"length": length, "prompt_tokens": len(out.prompt_token_ids), "depth": depth,
                         "key": key, "answer": out.text.strip(), "found": str(key) in out.text,
                         "seconds": round(time.perf_counter() - start, 3),
                         "prompt_token_ids": out.prompt_token_ids})
            print({k: v for k, v in rows[-1].items() if k != "prompt_token_ids"})
    return rows


def transformers_answers(model: str, tokenizer_dir: str, rows: list[dict]) -> list[dict]:
    """transformers' greedy answers on exactly the prompt ids astream saw (the reference)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = Path(model)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.bfloat16).to("cuda").eval()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    answers = []
    for row in rows:
        ids = torch.tensor([row["prompt_token_ids"]], device="cuda")
        with torch.no_grad():
            new = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                              do_sample=False)[0, ids.shape[1]:]
        text = tokenizer.decode(new, skip_special_tokens=True)
        answers.append({"answer": text.strip(), "found": str(row["key"]) in text})
        print("transformers", row["prompt_tokens"], row["depth"], answers[-1])
    return answers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="/tmp/qwen25coder05b.gguf")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--transformers", action="store_true",
                        help="also answer each prompt with transformers (GPU only)")
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    args = parser.parse_args()
    depths = [float(d) for d in args.depths.split(",")]
    if args.smoke:
        model, lengths, kw = smollm2(), [600], dict(device="cpu", dtype="float32", max_model_len=2048)
        offload_kw = dict(offload=True, kv_block_size=64, offload_slot_tokens=256)
    else:
        model, lengths, kw = args.model, [16384, 32000], dict(device="cuda", dtype="bfloat16",
                                                              max_model_len=32768, max_num_seqs=4)
        offload_kw = dict(offload=True)
    results = {}
    tokenizer_copy = "/tmp/astream-passkey-tokenizer"
    for name, extra in (("resident", {}), ("offload", {**offload_kw, "tokenizer": tokenizer_copy})):
        with LLM(model, **kw, **extra) as llm:
            if name == "resident":          # converting a GGUF tokenizer is slow: do it once
                llm.tokenizer.save_pretrained(tokenizer_copy)
            results[name] = run(llm, lengths, depths, seed=7)
    same = [a["answer"] == b["answer"] for a, b in zip(results["resident"], results["offload"])]
    results["identical_answers"] = same
    if args.transformers and not args.smoke:
        results["transformers"] = transformers_answers(model, tokenizer_copy, results["resident"])
    for row in results["resident"] + results["offload"]:
        row.pop("prompt_token_ids")
    save("passkey", results, smoke=args.smoke)
    reference = results.get("transformers") or [{}] * len(same)
    print(f"{'length':>7} {'depth':>5} {'key':>6} {'resident':>10} {'offload':>10} {'hf':>6} same")
    for a, b, h, s in zip(results["resident"], results["offload"], reference, same):
        print(f"{a['prompt_tokens']:>7} {a['depth']:>5} {a['key']:>6} {str(a['found']):>10} "
              f"{str(b['found']):>10} {str(h.get('found', '-')):>6} {s}")


if __name__ == "__main__":
    main()
