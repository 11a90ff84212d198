"""FP8 KV scales: the engine's per-(layer, KV head) calibrated scales against a finer choice,
one scale per (16-token block, KV head) taken from that block's own largest value, and
against one fixed scale (1.0), on a real model's keys and values.

A prompt (this repository's docs, ~2,000 tokens) runs through the model with exact
attention; per layer, the last 64 queries attend over every key with K/V stored in fp8 by
each scheme, and the attention output is compared with the exact one (relative L2 error,
mean over layers and query rows; also the stored values' own error).

    python benchmarks/fp8_scales.py                   # CPU, the embedded SmolLM2
    python benchmarks/fp8_scales.py --model M.gguf    # any model, GPU if there is one
"""

from __future__ import annotations

import argparse

import torch

from common import ROOT, save, smollm2  # noqa: I001
from astream import LLM
from astream.kvcache.calibration import HEADROOM, calibrate_format, calibration_ids
from astream.ops.attention import VarlenMeta, varlen_attention

BLOCK, QUERIES = 16, 64


def capture(llm: LLM, ids: list[int]) -> list[tuple[torch.Tensor, ...]]:
    decoder = llm.core.model.decoder
    n, device = len(ids), decoder.device
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    meta = VarlenMeta(cu, cu, n, n, [0, n], [0, n])
    layers = []

    def attend(layer, q, k, v):
        layers.append((q[-QUERIES:].float(), k.float(), v.float()))
        return varlen_attention(q, k, v, meta, causal=True, scale=decoder.config.head_dim ** -0.5)[0]

    with torch.inference_mode():
        decoder.forward(torch.tensor(ids, device=device), torch.arange(n, device=device), attend)
    return layers


def per_head(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [T, KVH, D] stored with scale [KVH] and read back."""
    top = torch.finfo(dtype).max
    return (x / scale.view(1, -1, 1)).clamp(-top, top).to(dtype).float() * scale.view(1, -1, 1)


def per_block(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One scale per (BLOCK tokens, KV head), from the block's own largest magnitude."""
    t = x.shape[0]
    pad = -t % BLOCK
    blocks = torch.cat((x, x.new_zeros(pad, *x.shape[1:]))).unflatten(0, (-1, BLOCK))
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12) / torch.finfo(dtype).max
    return ((blocks / scale).to(dtype).float() * scale).flatten(0, 1)[:t]


def attention(q, k, v, scale):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    probs = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) * scale, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    with LLM(args.model or smollm2(), device=device, dtype="float32", max_model_len=4096) as llm:
        ids = llm.tokenizer.encode(text)[:args.tokens]
        decoder = llm.core.model.decoder
        layers = capture(llm, ids)
        scale = decoder.config.head_dim ** -0.5
        rows = {}
        for name, dtype in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
            fmt = calibrate_format(decoder, calibration_ids(llm.tokenizer, decoder.config.vocab_size), dtype)
            ones = torch.ones_like(fmt.k_scale[0])
            schemes = {
                "per (layer, head), calibrated": lambda l, k, v: (per_head(k, fmt.k_scale[l], dtype),
                                                                  per_head(v, fmt.v_scale[l], dtype)),
                "per (16-token block, head)": lambda l, k, v: (per_block(k, dtype), per_block(v, dtype)),
                "one fixed scale, 1.0": lambda l, k, v: (per_head(k, ones, dtype), per_head(v, ones, dtype)),
            }
            for scheme, store in schemes.items():
                out_err, k_err, v_err = [], [], []
                for layer, (q, k, v) in enumerate(layers):
                    qk, qv = store(layer, k, v)
                    out_err.append(relative(attention(q, qk, qv, scale), attention(q, k, v, scale)))
                    k_err.append(relative(qk, k))
                    v_err.append(relative(qv, v))
                mean = lambda xs: round(sum(xs) / len(xs), 5)  # noqa: E731
                rows[f"{name} / {scheme}"] = {"attention_out_rel_err": mean(out_err),
                                              "attention_out_rel_err_max_layer": round(max(out_err), 5),
                                              "k_rel_err": mean(k_err), "v_rel_err": mean(v_err)}
    save("fp8_scales", {"model": str(args.model or "SmolLM2-135M-Instruct"), "tokens": len(ids),
                        "queries": QUERIES, "headroom": HEADROOM, "rows": rows})
    print(f"{'format / scales':<52}{'attn out err':>14}{'worst layer':>13}{'K err':>9}{'V err':>9}")
    for name, r in rows.items():
        print(f"{name:<52}{r['attention_out_rel_err']:>14.4f}{r['attention_out_rel_err_max_layer']:>13.4f}"
              f"{r['k_rel_err']:>9.4f}{r['v_rel_err']:>9.4f}")


if __name__ == "__main__":
    main()
