"""Quest with offload: how many of a decode step's pages could be on the device before the step
selects them, per way of predicting them.

    python benchmarks/run.py quest_prefetch [--model GGUF] [--context 2048] [--budget 512]
        [--steps 16] [--tasks needle,distractor,multikey,vartrack] [--depths 0.5] [--smoke]

With the KV cache in host memory a Quest layer selects its pages from its own query, then
gathers them over PCIe, then attends: the gather waits for the selection. A predictor names
pages early enough to fetch them off that path; what it misses is fetched late. For each
prompt (RULER-style problems of astream.eval at --context tokens, the answer generated
greedily) the model runs here layer by layer with exact attention over a plain KV cache, the
Quest page bounds kept by astream's ops (ops.quest) and every selection made by astream's
own (ops.quest_select, the policy's page size, sink, recent pages and GQA reduction; budget
--budget tokens; the one-level selection, which the policy uses up to 16384 pages). As with
offload, a step selects among the pages of its full KV blocks (--kv-block-size, offload's
256) and reads the newest block whole: that block is on the device anyway and counts for no
predictor. The prompt's last token is decode step 0; steps 1..--steps are scored, on every
layer from the policy's dense_layers on.

Predictors (a page set per layer, step and KV head):

- `exact`: the pages Quest selects from the layer's true query: the self-check (1.0), and
  what keys on the device with values from the host would read (exact selection, no guess);
- `prev_step`: the same layer's exact pages one step before (what `reuse_pages` holds);
- `prev_layer`: the previous layer's exact pages this step, the same KV head;
- `early_query`: the pages selected by layer l's query projected early from the residual
  stream entering layer l-1 (layer l's input norm and Q projection, q norm where the model
  has one, RoPE at the current position), against layer l's page bounds;
- `early_query_wide`: the same query's top --cap x budget pages;
- `prev_step+early_query`: the early query's pages, then the previous step's, ranked by the
  early query's page scores, up to --cap x budget pages (the same device memory as the wide
  one).

Figures per predictor, P its pages and E the exact ones, per (layer, step, KV head) or per
query head: `page_recall` |P & E| / |E|; `mass_recall` the true softmax mass (the query
head's, over the whole context) inside P & E over that inside E; `mass_ratio` the mass
attention would read from P plus the newest block over that of E plus the block (above 1
where P holds more of it); `late` |E - P| / budget pages: the pages still to fetch on the
critical path; `device` |P| / budget pages. Each as a mean and a 10th percentile (p10) over
the samples (one per prompt, step, layer and KV or query head); per-layer means and the
generated answers in the rows' info.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F

from common import smollm2  # noqa: I001  (sets sys.path)
from astream.eval.scoring import score
from astream.eval.trials import build_trial
from astream.models.loader import load_model, open_checkpoint, resolve_model_path
from astream.ops import quest as quest_ops
from astream.ops.attention import varlen_attention
from astream.ops.quest_select import page_scores_ref, physical_page_ids, select_decode_pages
from astream.ops.varlen import VarlenMeta
from astream.policies.quest import QuestPolicy

PREDICTORS = ("exact", "prev_step", "prev_layer", "early_query", "early_query_wide",
              "prev_step+early_query")
DEFAULTS = dict(context=2048, budget=512, steps=16, tasks="needle,distractor,multikey,vartrack",
                depths="0.5")
SMOKE = dict(context=640, budget=128, steps=3, tasks="needle", depths="0.5")


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="a GGUF file or model folder (default: SmolLM2)")
    parser.add_argument("--context", type=int, default=None,
                        help=f"prompt tokens [{DEFAULTS['context']}]")
    parser.add_argument("--budget", type=int, default=None,
                        help=f"Quest budget tokens [{DEFAULTS['budget']}]")
    parser.add_argument("--steps", type=int, default=None, help=f"decode steps scored [{DEFAULTS['steps']}]")
    parser.add_argument("--tasks", default=None, help=f"astream.eval tasks [{DEFAULTS['tasks']}]")
    parser.add_argument("--depths", default=None, help=f"needle depths, one prompt each [{DEFAULTS['depths']}]")
    parser.add_argument("--cap", type=float, default=1.5,
                        help="device pages of the wide and union predictors, x budget [1.5]")
    parser.add_argument("--kv-block-size", type=int, default=256,
                        help="the KV block; the newest one is read whole [256, offload's]")
    parser.add_argument("--dtype", default=None, help="model dtype [float32 on the CPU, else bfloat16]")
    parser.add_argument("--seed", type=int, default=0)


def settings(options) -> dict:
    """The benchmark's own options with the defaults (--smoke: the smoke ones) filled in."""
    base = SMOKE if options.smoke else DEFAULTS
    return {key: getattr(options, key) if getattr(options, key) is not None else value
            for key, value in base.items()}


# ---------------------------------------------------------------- page sets and their recall

def page_mask(indices: torch.Tensor, counts: torch.Tensor, n_pages: int) -> torch.Tensor:
    """A selection's first `counts` entries [KVH, W] as a mask [KVH, n_pages]."""
    real = torch.arange(indices.shape[-1], device=indices.device) < counts.unsqueeze(-1)
    mask = torch.zeros(indices.shape[0], n_pages + 1, dtype=torch.bool, device=indices.device)
    # Pads go to the spare last column, dropped after.
    return mask.scatter_(1, torch.where(real, indices.long(), n_pages), True)[:, :n_pages]


def ranked_union(first: torch.Tensor, then: torch.Tensor, scores: torch.Tensor, cap: int) -> torch.Tensor:
    """Masks [KVH, P]: every page of `first`, then pages of `then` by `scores` [KVH, P], at most
    `cap` pages in all (`first` itself is never cut)."""
    rank = torch.where(first, float("inf"), torch.where(then, scores.float(), float("-inf")))
    k = min(cap, rank.shape[-1])
    top = rank.topk(k, dim=-1).indices
    keep = torch.zeros_like(first).scatter_(1, top, True) & (first | then)
    return keep | first


def recall(predicted: torch.Tensor, exact: torch.Tensor, page_mass: torch.Tensor,
           tail_mass: torch.Tensor, budget_pages: int) -> dict[str, torch.Tensor]:
    """predicted, exact [KVH, P] page masks; page_mass [H, P] a query head's softmax mass per
    page, tail_mass [H] that of the newest block (read whole, outside P). Per KV head:
    page_recall, late, device; per query head: mass_recall, mass_ratio."""
    group = page_mass.shape[0] // exact.shape[0]
    hit = (predicted & exact).sum(-1).float()
    wanted = exact.sum(-1).float()
    per_head = lambda mask: (page_mass * mask.repeat_interleave(group, 0)).sum(-1)  # noqa: E731
    in_exact, in_both = per_head(exact), per_head(predicted & exact)
    return {"page_recall": torch.where(wanted > 0, hit / wanted.clamp(min=1), 1.0),
            "late": (wanted - hit) / budget_pages,
            "device": predicted.sum(-1).float() / budget_pages,
            "mass_recall": torch.where(in_exact > 0, in_both / in_exact.clamp(min=1e-30), 1.0),
            "mass_ratio": (per_head(predicted) + tail_mass) / (in_exact + tail_mass)}


# ---------------------------------------------------------------- one prompt, layer by layer

@dataclass
class Scores:
    """The samples of every figure, per predictor, with the layer of each."""

    values: dict[str, dict[str, list[torch.Tensor]]] = field(
        default_factory=lambda: {p: {} for p in PREDICTORS})
    layers: dict[str, dict[str, list[torch.Tensor]]] = field(
        default_factory=lambda: {p: {} for p in PREDICTORS})

    def add(self, predictor: str, layer: int, figures: dict[str, torch.Tensor]) -> None:
        for name, value in figures.items():
            self.values[predictor].setdefault(name, []).append(value.float().cpu())
            self.layers[predictor].setdefault(name, []).append(torch.full(value.shape, layer))

    def summary(self, predictor: str) -> tuple[dict, dict]:
        """(figures: mean and p10 of each, info: per-layer means)."""
        figures, by_layer = {}, {}
        for name, chunks in self.values[predictor].items():
            x, layer = torch.cat(chunks).double(), torch.cat(self.layers[predictor][name])
            figures[f"{name}_mean"] = round(x.mean().item(), 4)
            figures[f"{name}_p10"] = round(x.quantile(0.1).item(), 4)
            by_layer[name] = {int(lay): round(x[layer == lay].mean().item(), 4)
                              for lay in layer.unique().tolist()}
        counts = {name: sum(c.numel() for c in chunks) for name, chunks in self.values[predictor].items()}
        return figures, {"by_layer": by_layer, "kv_head_samples": counts["page_recall"],
                         "query_head_samples": counts["mass_recall"]}


class Probe:
    """The model run on one prompt with exact attention over a plain KV cache, scoring every
    predictor at each layer and step as it goes."""

    def __init__(self, decoder, policy: QuestPolicy, block_size: int, max_len: int, cap: float,
                 scores: Scores) -> None:
        cfg = decoder.config
        self.decoder, self.policy, self.block_size = decoder, policy, block_size
        self.cap, self.scores = cap, scores
        device, dtype = decoder.device, decoder.dtype
        n_blocks = -(-max_len // block_size) + 1
        shape = (n_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.bounds = [quest_ops.allocate_page_bounds(n_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                                      dtype=dtype, device=device, page_size=policy.page_size)
                       for _ in range(cfg.num_layers)]
        self.tables = torch.arange(n_blocks, dtype=torch.int32, device=device).view(1, -1)
        self.scale = cfg.head_dim ** -0.5
        self.length = 0
        self.step = -1
        self.early: dict[int, torch.Tensor] = {}
        self.chosen: dict[int, torch.Tensor] = {}          # this step's exact masks, per layer
        self.before: dict[int, torch.Tensor] = {}          # the previous step's

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        slots = torch.arange(start, start + k.shape[0], device=k.device)
        self.k[layer][slots], self.v[layer][slots] = k, v
        quest_ops.update_page_bounds(*self.bounds[layer], k, slots, self.policy.page_size)

    def prefill(self, ids: list[int]) -> None:
        n, device = len(ids), self.decoder.device
        meta = VarlenMeta.single(n, n, device)

        def attend(layer, q, k, v):
            self.write(layer, k, v, 0)
            return varlen_attention(q, k, v, meta, causal=True, scale=self.scale)[0]

        self.decoder.forward(torch.tensor(ids, device=device), torch.arange(n, device=device), attend)
        self.length = n

    def decode(self, token: int) -> int:
        """One step on `token`; the greedy next token."""
        decoder, device, t = self.decoder, self.decoder.device, self.length
        self.step += 1
        self.before, self.chosen, self.early = self.chosen, {}, {}
        positions = torch.tensor([t], device=device)
        stream = decoder.embed(torch.tensor([token], device=device))
        for layer in range(decoder.config.num_layers):
            if layer + 1 < decoder.config.num_layers:
                self.early[layer + 1] = self.early_query(layer + 1, stream, positions)
            stream = decoder.layer(layer, stream, positions, self.attend)
        self.length += 1
        return int(decoder.logits(decoder.final_norm(stream)).argmax(-1)[0])

    def early_query(self, layer: int, stream, positions: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s query from the residual stream entering the layer before it."""
        cfg, w, ops = self.decoder.config, self.decoder.weights.layers[layer], self.decoder.kernels
        x, _ = ops.add_rms_norm(stream.hidden, stream.pending, w.input_norm, cfg.rms_norm_eps)
        q, _, _ = ops.qkv_rope(F.linear(x, w.qkv, w.qkv_bias), positions, self.decoder.rope.cos,
                               self.decoder.rope.sin, cfg.num_heads, cfg.num_kv_heads, w.q_norm,
                               w.k_norm, cfg.rms_norm_eps)
        return q[0]

    def select(self, layer: int, q: torch.Tensor, full: int, budget_pages: int) -> torch.Tensor:
        """Quest's pages for q [H, D] among the first `full` tokens' pages, as a mask [KVH, P]."""
        p = self.policy
        n_pages = full // p.page_size
        chosen = select_decode_pages(
            q.unsqueeze(0), *self.bounds[layer], self.tables,
            torch.tensor([full], dtype=torch.int32, device=q.device), max_pages=n_pages,
            block_size=self.block_size, page_size=p.page_size, budget_pages=budget_pages,
            sink_pages=p.sink_pages, recent_pages=p.recent_pages, gqa_reduce=p.gqa_reduce)
        return page_mask(chosen.indices[0], chosen.counts[0], n_pages)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = self.length
        self.write(layer, k, v, t)
        group = q.shape[1] // k.shape[1]
        keys = self.k[layer][:t + 1].repeat_interleave(group, 1)
        values = self.v[layer][:t + 1].repeat_interleave(group, 1)
        probs = torch.einsum("hd,thd->ht", q[0].float(), keys.float()).mul_(self.scale).softmax(-1)
        out = torch.einsum("ht,thd->hd", probs, values.float()).to(q.dtype).unsqueeze(0)
        full = t // self.block_size * self.block_size
        if full // self.policy.page_size > 0:
            self.chosen[layer] = self.select(layer, q[0], full, self.policy.budget_pages)
            if layer >= self.policy.dense_layers and self.step >= 1:
                self.score(layer, probs, full)
        return out

    def score(self, layer: int, probs: torch.Tensor, full: int) -> None:
        p, budget = self.policy, self.policy.budget_pages
        n_pages = full // p.page_size
        page_mass = probs[:, :full].unflatten(1, (n_pages, p.page_size)).sum(-1)
        tail = probs[:, full:].sum(-1)
        exact = self.chosen[layer]
        early_q = self.early[layer]
        early = self.select(layer, early_q, full, budget)
        wide_cap = max(budget, int(self.cap * budget))
        ids, num = physical_page_ids(self.tables, torch.tensor([full], device=probs.device),
                                     max_pages=n_pages, block_size=self.block_size, page_size=p.page_size)
        early_scores = page_scores_ref(early_q.unsqueeze(0), *self.bounds[layer], ids, num,
                                       gqa_reduce=p.gqa_reduce)[0]
        before = self.before.get(layer, exact[:, :0])
        before = F.pad(before, (0, n_pages - before.shape[-1]))    # a block filled since: none of its pages
        predicted = {
            "exact": exact, "prev_step": before, "prev_layer": self.chosen[layer - 1],
            "early_query": early, "early_query_wide": self.select(layer, early_q, full, wide_cap),
            "prev_step+early_query": ranked_union(early, before, early_scores, wide_cap)}
        for name, mask in predicted.items():
            self.scores.add(name, layer, recall(mask, exact, page_mass, tail, budget))


# ---------------------------------------------------------------- the harness

def run_prompts(options) -> tuple[Scores, list[dict], dict]:
    s = settings(options)
    dtype = getattr(torch, options.dtype or ("float32" if options.device == "cpu" else "bfloat16"))
    device = torch.device(options.device)
    loaded = load_model(open_checkpoint(resolve_model_path(options.model or smollm2())), dtype, device)
    decoder, tokenizer = loaded.decoder, loaded.tokenizer
    policy = QuestPolicy(budget_tokens=s["budget"])
    scores, answers = Scores(), []
    depths = [float(d) for d in str(s["depths"]).split(",") if d]
    for task in str(s["tasks"]).split(","):
        for depth in depths:
            trial = build_trial(tokenizer, task, s["context"], depth, 0, seed=options.seed)
            ids = list(trial.prompt_ids)
            probe = Probe(decoder, policy, options.kv_block_size, len(ids) + s["steps"] + 1, options.cap,
                          scores)
            with torch.inference_mode():
                probe.prefill(ids[:-1])
                token, out = ids[-1], []
                for _ in range(s["steps"] + 1):
                    token = probe.decode(token)
                    out.append(token)
            text = tokenizer.decode(out, skip_special_tokens=True)
            answers.append({"task": task, "depth": depth, "prompt_tokens": len(ids), "answer": text,
                            "expected": list(trial.expected),
                            "correct": score(text, trial.expected, trial.kind).correct})
    shape = {"model": Path(loaded.path).name, "layers": decoder.config.num_layers,
             "heads": decoder.config.num_heads, "kv_heads": decoder.config.num_kv_heads,
             "head_dim": decoder.config.head_dim, "dtype": str(dtype).removeprefix("torch."),
             "page_size": policy.page_size, "budget_pages": policy.budget_pages,
             "dense_layers": policy.dense_layers, "gqa_reduce": policy.gqa_reduce}
    return scores, answers, shape


def cases(options) -> Iterator[tuple[dict, object]]:
    s = settings(options)
    scores, answers, shape = run_prompts(options)
    for predictor in PREDICTORS:
        figures, info = scores.summary(predictor)
        info = {**info, **shape}
        if predictor == "exact":
            info["answers"] = answers
            info["correct"] = sum(a["correct"] for a in answers)
        params = {"predictor": predictor, "context": s["context"], "budget": s["budget"],
                  "steps": s["steps"]}
        yield params, (lambda figures=figures, info=info: {**figures, "info": info})


def summarize(result: dict) -> None:
    print("\n| predictor | page recall mean / p10 | mass recall mean / p10 | mass read vs exact "
          "| late pages (x budget) | device pages (x budget) |")
    print("|---|---|---|---|---|---|")
    for row in result["rows"]:
        f = {key: value["median"] for key, value in row["figures"].items()}
        print(f"| {row['params']['predictor']} | {f['page_recall_mean']:.3f} / {f['page_recall_p10']:.3f} "
              f"| {f['mass_recall_mean']:.3f} / {f['mass_recall_p10']:.3f} | {f['mass_ratio_mean']:.3f} "
              f"| {f['late_mean']:.3f} | {f['device_mean']:.2f} |")
