"""GPU correctness on the embedded model: bf16 on the GPU (CUDA graphs, and with KV offload)
against the float32 CPU run, greedy, 5 prompts. Any divergence is shown with the logit
margins of both runs at that step.

    python benchmarks/gpu_correctness.py            # on the GPU machine
    python benchmarks/gpu_correctness.py --smoke    # CPU only, checks the script itself
"""

from __future__ import annotations

import argparse

import torch

from common import save, smollm2  # noqa: I001  (sets sys.path)
from astream import LLM, SamplingParams
from astream.ops.attention import VarlenMeta, varlen_attention

PROMPTS = [
    "The quick brown fox",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    [{"role": "user", "content": "What is the capital of France?"}],
]


def last_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    decoder = llm.core.model.decoder
    n, device = len(ids), decoder.device
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    meta = VarlenMeta(cu, cu, n, n, [0, n], [0, n])
    scale = decoder.config.head_dim ** -0.5

    def attend(layer, q, k, v):
        return varlen_attention(q, k, v, meta, causal=True, scale=scale)[0]

    with torch.inference_mode():
        hidden = decoder.forward(torch.tensor(ids, device=device), torch.arange(n, device=device), attend)
        return decoder.logits(hidden[-1:])[0].float().cpu()


def divergence(reference: LLM, other: LLM, prompt_ids: list[int], a: list[int], b: list[int]) -> dict | None:
    step = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if step is None:
        return None
    ids = prompt_ids + a[:step]
    out = {"step": step, "reference_token": a[step], "other_token": b[step]}
    for name, llm in (("reference", reference), ("other", other)):
        logits = last_logits(llm, ids)
        top2 = logits.topk(2).values
        out[f"{name}_top2_margin"] = float(top2[0] - top2[1])
        out[f"{name}_logit_gap_between_the_two"] = float(logits[a[step]] - logits[b[step]])
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens)
    model = smollm2()
    runs = {}
    with LLM(model, device="cpu", dtype="float32", num_kv_blocks=512, max_model_len=2048) as cpu:
        runs["cpu_fp32"] = cpu.generate(PROMPTS, params)
        variants = {"gpu_bf16": dict(), "gpu_bf16_eager": dict(enforce_eager=True),
                    "gpu_bf16_offload": dict(offload=True, max_model_len=4096)}
        results = {}
        for name, extra in variants.items():
            kw = dict(device=device, dtype="bfloat16" if not args.smoke else "float32", **extra)
            kw.setdefault("max_model_len", 2048)
            with LLM(model, **kw) as llm:
                outs = llm.generate(PROMPTS, params)
                rows = []
                for prompt, ref, got in zip(PROMPTS, runs["cpu_fp32"], outs):
                    rows.append({"prompt": prompt if isinstance(prompt, str) else prompt[0]["content"],
                                 "identical": ref.token_ids == got.token_ids,
                                 "text": got.text,
                                 "divergence": divergence(cpu, llm, ref.prompt_token_ids,
                                                          ref.token_ids, got.token_ids)})
                results[name] = rows
    results["cpu_fp32"] = [{"text": o.text, "tokens": o.token_ids} for o in runs["cpu_fp32"]]
    save("gpu_correctness", results, smoke=args.smoke)
    print(f"{'variant':<18} identical prompts")
    for name in variants:
        same = sum(r["identical"] for r in results[name])
        print(f"{name:<18} {same}/{len(PROMPTS)}")
        for r in results[name]:
            if r["divergence"]:
                print("   diverges:", r["prompt"][:30], r["divergence"])


if __name__ == "__main__":
    main()
