"""GPU correctness on the embedded model: bf16 on the GPU (CUDA graphs, eager, and with KV
offload; Quest resident and offloaded, from graphs and eager) against the float32 CPU run,
greedy, 5 prompts x 32 tokens. The CPU reference is
computed once on a CPU machine (`--reference`) and stored in benchmarks/results; a
divergence is shown with the GPU model's logit margin at that step.

    python benchmarks/gpu_correctness.py --reference   # CPU machine: writes the reference
    python benchmarks/gpu_correctness.py               # GPU machine: compares with it
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from common import RESULTS, save, smollm2  # noqa: I001  (sets sys.path)
from astream import LLM, SamplingParams
from astream.executor.build import build_graphs
from astream.ops.attention import VarlenMeta, varlen_attention
from astream.ops.layer_kernels import LayerKernels
from astream.policies import QuestPolicy

PROMPTS = [
    "The quick brown fox",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    [{"role": "user", "content": "What is the capital of France?"}],
]
REFERENCE = RESULTS / "cpu_reference_smollm2.json"
# Quest with a budget the prompts outgrow, in pages of 8 tokens: the offloaded part of a
# context (its full 16-token blocks, at most 32 tokens here) still has pages to leave out.
# Resident, offload from CUDA graphs, offload eager, offload keeping pages between steps,
# offload loading pages a layer ahead (from graphs and eager), and reading only those pages
# (late_fetch=False, from graphs and eager; and from graphs loading only the pages a row's
# slots do not hold).
QUEST = {"kv_block_size": 16, "sparse_policy": QuestPolicy(budget_tokens=24, page_size=8)}
QUEST_VARIANTS = {"quest": {}, "offload_quest_graphs": {"offload": True},
                  "offload_quest_eager": {"offload": True, "enforce_eager": True},
                  "offload_quest_reuse_graphs": {
                      "offload": True,
                      "sparse_policy": dataclasses.replace(QUEST["sparse_policy"], reuse_pages=True)},
                  "offload_quest_prefetch_graphs": {
                      "offload": True,
                      "sparse_policy": dataclasses.replace(QUEST["sparse_policy"], prefetch=1.5)},
                  "offload_quest_prefetch_eager": {
                      "offload": True, "enforce_eager": True,
                      "sparse_policy": dataclasses.replace(QUEST["sparse_policy"], prefetch=1.5)},
                  "offload_quest_predicted_graphs": {
                      "offload": True, "sparse_policy": dataclasses.replace(
                          QUEST["sparse_policy"], prefetch=1.5, late_fetch=False)},
                  "offload_quest_predicted_eager": {
                      "offload": True, "enforce_eager": True, "sparse_policy": dataclasses.replace(
                          QUEST["sparse_policy"], prefetch=1.5, late_fetch=False)},
                  "offload_quest_predicted_reuse_graphs": {
                      "offload": True, "sparse_policy": dataclasses.replace(
                          QUEST["sparse_policy"], prefetch=1.5, late_fetch=False, reuse_pages=True)}}
DENSE_VARIANTS = {"offload16_graphs": {"offload": True, "kv_block_size": 16},
                  "offload16_eager": {"offload": True, "kv_block_size": 16, "enforce_eager": True}}


def last_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    return all_logits(llm.core.model.decoder, ids)[-1]


def all_logits(decoder, ids: list[int]) -> torch.Tensor:
    """float32 logits at every position of `ids` (one dense forward), on the CPU."""
    n, device = len(ids), decoder.device
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    meta = VarlenMeta(cu, cu, n, n, [0, n], [0, n])
    scale = decoder.config.head_dim ** -0.5

    def attend(layer, q, k, v):
        return varlen_attention(q, k, v, meta, causal=True, scale=scale)[0]

    with torch.inference_mode():
        hidden = decoder.forward(torch.tensor(ids, device=device), torch.arange(n, device=device), attend)
        return decoder.logits(hidden).float().cpu()


def kernel_agreement(decoder, reference: list[dict]) -> dict:
    """The fused layer kernels against the torch references on this GPU, teacher-forced on the
    CPU reference's tokens: the largest logit difference, and the positions whose argmax
    differs with the top-2 margin there (in the reference kernels' logits)."""
    chosen = decoder.kernels
    logits = {}
    for name in ("reference", "triton"):
        decoder.kernels = LayerKernels(name)
        logits[name] = [all_logits(decoder, r["prompt_ids"] + r["tokens"]) for r in reference]
    decoder.kernels = chosen
    flips, worst = [], 0.0
    for ref, fused in zip(logits["reference"], logits["triton"]):
        worst = max(worst, float((ref - fused).abs().max()))
        for pos in (ref.argmax(-1) != fused.argmax(-1)).nonzero().flatten().tolist():
            top2 = ref[pos].topk(2).values
            flips.append(round(float(top2[0] - top2[1]), 4))
    positions = sum(len(r["prompt_ids"]) + len(r["tokens"]) for r in reference)
    return {"positions": positions, "max_abs_logit_diff": round(worst, 4),
            "argmax_differs": len(flips), "top2_margins_where_differs": flips}


def divergence(llm: LLM, prompt_ids: list[int], ref: list[int], got: list[int]) -> dict | None:
    step = next((i for i, (x, y) in enumerate(zip(ref, got)) if x != y), None)
    if step is None:
        return None
    logits = last_logits(llm, prompt_ids + ref[:step])
    top2 = logits.topk(2).values
    return {"step": step, "cpu_token": ref[step], "gpu_token": got[step],
            "gpu_top2_margin": round(float(top2[0] - top2[1]), 4),
            "gpu_logit_gap_gpu_minus_cpu_token": round(float(logits[got[step]] - logits[ref[step]]), 4)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="CPU variants, checks the script")
    parser.add_argument("--kv-cache-dtype", default="auto", help="every GPU variant's KV dtype")
    parser.add_argument("--layer-kernels", default=None,
                        help="decoder kernels of every variant: reference | triton (default: the engine's)")
    parser.add_argument("--only", default=None, help="run only these variants, e.g. gpu_bf16_graphs")
    args = parser.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=32)
    if args.reference:
        with LLM(smollm2(), device="cpu", dtype="float32", num_kv_blocks=512, max_model_len=2048) as cpu:
            outs = cpu.generate(PROMPTS, params)
        REFERENCE.write_text(json.dumps([{"prompt_ids": o.prompt_token_ids, "tokens": o.token_ids,
                                          "text": o.text} for o in outs], indent=1))
        return
    reference = json.loads(REFERENCE.read_text())
    device, dtype = ("cpu", "float32") if args.smoke else ("cuda", "bfloat16")
    variants = {"gpu_bf16_graphs": {}, "gpu_bf16_eager": {"enforce_eager": True},
                "gpu_bf16_offload": {"offload": True},
                # 16-token blocks reach the host early: Full's decode from CUDA graphs gathers them.
                **{f"gpu_bf16_{name}": extra for name, extra in DENSE_VARIANTS.items()},
                **{f"gpu_bf16_{name}": {**QUEST, **extra} for name, extra in QUEST_VARIANTS.items()}}
    if args.only:
        variants = {name: extra for name, extra in variants.items() if name in args.only.split(",")}
    results, tokens = {}, {}
    for name, extra in variants.items():
        with LLM(smollm2(), device=device, dtype=dtype, max_model_len=2048,
                 kv_cache_dtype=args.kv_cache_dtype, **extra) as llm:
            if args.layer_kernels:
                use_kernels(llm, args.layer_kernels)
            if name == "gpu_bf16_graphs" and not args.smoke:
                results["fused_vs_reference_kernels"] = kernel_agreement(llm.core.model.decoder, reference)
                print("fused vs reference kernels:", results["fused_vs_reference_kernels"], flush=True)
            outs = llm.generate([r["prompt_ids"] for r in reference], params)
            stats = llm.stats()
            graph_steps = stats["graph_steps"]
            if "quest_pages_read" in stats:     # summed over layers
                results[f"{name}_pages"] = {key: sum(stats.get(key, [])) for key in
                                            ("quest_pages_read", "quest_pages_loaded",
                                             "quest_pages_loaded_late")}
                print(f"{name} pages:", results[f"{name}_pages"], flush=True)
            # Sampling at the end of one graph (resident), and after a chain of them (offload, Full).
            key = {"gpu_bf16_graphs": "graph_sampling",
                   "gpu_bf16_offload16_graphs": "graph_sampling_offload16"}.get(name)
            if key is not None:
                results[key] = graph_sampling(llm, reference, [o.token_ids for o in outs])
                print(f"sampling inside the graphs ({name}):", results[key], flush=True)
            results[name] = [{"identical": ref["tokens"] == out.token_ids, "text": out.text,
                              "divergence": divergence(llm, ref["prompt_ids"], ref["tokens"], out.token_ids)}
                             for ref, out in zip(reference, outs)]
        tokens[name] = [out.token_ids for out in outs]
        print(name, sum(r["identical"] for r in results[name]), "/", len(reference),
              f"identical to the CPU; {graph_steps} steps from CUDA graphs", flush=True)
        for r in results[name]:
            if r["divergence"]:
                print("   ", r["divergence"], flush=True)
    # Quest at a budget below the context is not Full: its variants are compared with each other.
    quest = [f"gpu_bf16_{name}" for name in QUEST_VARIANTS if f"gpu_bf16_{name}" in tokens]
    results["quest_agreement"] = {
        f"{a} vs {b}": sum(x == y for x, y in zip(tokens[a], tokens[b])) for a, b in zip(quest, quest[1:])}
    print("Quest, same tokens (of 5):", results["quest_agreement"], flush=True)
    dense = [f"gpu_bf16_{name}" for name in DENSE_VARIANTS if f"gpu_bf16_{name}" in tokens]
    if len(dense) == 2:
        results["offload_graphs_agreement"] = sum(x == y for x, y in zip(*(tokens[d] for d in dense)))
        print("Full offload, graphs vs eager ring, same tokens (of 5):",
              results["offload_graphs_agreement"], flush=True)
    kv = "" if args.kv_cache_dtype == "auto" else f"_{args.kv_cache_dtype}"
    kernels = f"_{args.layer_kernels}" if args.layer_kernels else ""
    only = "_only" if args.only else ""
    save(f"gpu_correctness{kv}{kernels}{only}", results, smoke=args.smoke)


def graph_sampling(llm: LLM, reference: list[dict], greedy: list[list[int]]) -> dict:
    """Temperature rows sample inside the graphs: near zero they give the greedy tokens, at 1.0
    two runs differ (the generator advances with each replay); seeded rows (sampled on the
    host) repeat exactly."""
    prompts = [r["prompt_ids"] for r in reference]
    before = llm.stats()["graph_steps"]
    # Greedy again under the same conditions as the runs below (their prompts now come from
    # the prefix cache, which changes the prefill's chunking and so its bf16 rounding).
    greedy = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32))]
    cold = llm.generate(prompts, SamplingParams(temperature=1e-4, max_tokens=32))
    hot = [llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True))
           for _ in range(2)]
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=32, ignore_eos=True)
    again = [llm.generate(prompts, seeded) for _ in range(2)]
    # bf16 logits tie often (one bf16 unit is 0.125 at 16-32): the argmax takes the lower id,
    # sampling either, so a near-zero temperature may leave the greedy path only at a tie.
    return {"near_zero_equals_greedy": sum(o.token_ids == g for o, g in zip(cold, greedy)),
            "near_zero_first_divergences": [divergence(llm, r["prompt_ids"], g, o.token_ids)
                                            for r, g, o in zip(reference, greedy, cold)
                                            if o.token_ids != g],
            "temperature_1_runs_differ": sum(a.token_ids != b.token_ids for a, b in zip(*hot)),
            "seeded_repeat": sum(a.token_ids == b.token_ids for a, b in zip(*again)),
            "graph_steps": llm.stats()["graph_steps"] - before}


def use_kernels(llm: LLM, name: str) -> None:
    """Run `llm` on the named decoder kernels, its CUDA graphs captured again with them."""
    runner = llm.core.runner
    runner.decoder.kernels = LayerKernels(name)
    if runner.graphs is not None:
        runner.graphs = None
        runner.graphs = build_graphs(llm.core.config, llm.core.plan, runner)


if __name__ == "__main__":
    main()
