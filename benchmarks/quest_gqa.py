"""Quest with grouped-query heads: how much of each query head's attention the pages chosen
for its KV head hold, per rule that reduces the group's page scores to one.

    python benchmarks/run.py quest_gqa [--model GGUF] [--context 2048] [options]
    python benchmarks/run.py quest_gqa --model /tmp/qwen25coder05b.gguf --context 16384

A real model (default: the embedded SmolLM2-135M) reads one prompt of `--context` tokens per
RULER-style task of `astream eval` (`--tasks`, trial 0 at `--depth`, the eval's own seeded
prompts) followed by its expected answer; astream's exact prefill captures every layer's
post-RoPE Q and K (benchmarks/sparse_reference.py `capture`). The decode queries are the
positions that predict the answer's tokens (the prompt's last one first; at most
`--queries`, spread over the answer), each over the keys up to it, on every layer from
QuestPolicy's `dense_layers` on. As the engine's resident path reads them (KV block = page =
`--page-size` tokens): the pages of the full blocks are chosen, the first and the newest of
them forced, and the newest block (the one holding the query) is read whole besides.

Figure: attention-mass recall, per query head, the share of its exact softmax attention
over the whole context that lies in the pages read for its KV head; `recall_mean` and
`recall_p10` (10th percentile) over layers, queries and heads, per rule and budget
(`--budgets`: fractions of the context, or token counts above 1).

Rules (page scores s_h(p) = sum_i max(q_i kmin_i, q_i kmax_i) per query head h):

- `max`, `sum`: max / sum over the group (QuestPolicy gqa_reduce "max", "sum");
- `relative`: max over the group of s_h(p) - max_p' s_h(p'), each head's best page at 0
  (gqa_reduce "relative");
- `qnorm`: max over the group of s_h(p) / |q_h|;
- `share`, `share_max`: each head's estimated share of its attention in the page, the
  softmax over pages of s_h / sqrt(d), summed (ranked by its log) / maxed over the group;
- `rank`: a union by rank, each page scored by its best rank in any head of the group (ties
  by `relative`);
- references, not rules a KV head can apply: `per_head`, each query head its own Quest pages
  (multi-head Quest, the budget per query head); `oracle`, the pages holding the most of the
  group's exact attention (the best mean any one selection per KV head reaches).

Rules that are QuestPolicy gqa_reduce options (max, sum, relative) are also run through the engine's selection
(QuestRuntime.select_decode: the Triton kernels on CUDA) on the same inputs: `engine_jaccard`
is the mean Jaccard index of its pages against this restatement's (1.0 on the CPU; near-ties
may part on CUDA, where scores are summed in another order); below 0.98 the row fails.
"""

from __future__ import annotations

import statistics
from typing import Iterator

import torch

from common import percentile, smollm2  # noqa: I001
from astream import LLM
from astream.eval.tasks import RULER_TASKS
from astream.eval.tokenizer import load_tokenizer
from astream.eval.trials import build_trial
from astream.ops import quest as quest_ops
from astream.ops.quest_select import select_pages
from astream.policies.base import KVLayout
from astream.policies.quest import QuestPolicy
from sparse_reference import astream_quest_pages, capture

RULES = ("max", "sum", "relative", "qnorm", "share", "share_max", "rank", "per_head", "oracle")
ENGINE_RULES = tuple(r for r in RULES if r in quest_ops.GQA_REDUCTIONS)


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="a GGUF (default: the embedded SmolLM2)")
    parser.add_argument("--context", type=int, default=2048, help="tokens of each prompt")
    parser.add_argument("--tasks", default=",".join(RULER_TASKS), help="RULER-style tasks, a prompt each")
    parser.add_argument("--depth", type=float, default=0.5, help="of the sentence asked about")
    parser.add_argument("--queries", type=int, default=8, help="decode positions per prompt at most")
    parser.add_argument("--budgets", default="0.125,0.25",
                        help="fractions of the context, or token counts (comma list)")
    parser.add_argument("--rules", default=",".join(RULES), help="comma list of " + ", ".join(RULES))
    parser.add_argument("--page-size", type=int, default=QuestPolicy().page_size)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")


class Query:
    """One decode query of one layer: per query head, its page scores and exact attention."""

    def __init__(self, layer: int, t: int, q: torch.Tensor, k: torch.Tensor, page: int):
        self.layer, self.t, self.q = layer, t, q
        n_heads, head_dim = q.shape
        group = n_heads // k.shape[1]
        full = t // page                      # pages of the blocks before the query's
        keys = k[:full * page].view(full, page, *k.shape[1:])
        kmin, kmax = quest_ops.bounds_of_blocks(keys, page)              # [P, KVH, D]
        qf = q.float()
        heads = torch.arange(n_heads, device=q.device) // group
        lo, hi = kmin.float()[:, heads], kmax.float()[:, heads]          # [P, H, D]
        self.scores = (qf.clamp(min=0) * hi + qf.clamp(max=0) * lo).sum(-1).T.contiguous()  # [H, P]
        logits = torch.einsum("hd,thd->ht", qf, k[:t + 1].float()[:, heads]) * head_dim ** -0.5
        probs = torch.softmax(logits, -1)
        self.mass = probs[:, :full * page].view(n_heads, full, page).sum(-1)   # [H, P]
        self.newest = probs[:, full * page:].sum(-1)                          # [H]
        self.group, self.scale = group, head_dim ** -0.5

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(-1, self.group, x.shape[-1])                 # [KVH, G, P]

    def rule_scores(self, rule: str) -> torch.Tensor:
        """[KVH, P] scores of `rule` (per_head: [H, P], one selection per query head)."""
        s = self.scores
        relative = s - s.amax(-1, keepdim=True)
        share = torch.log_softmax(s * self.scale, -1)
        if rule == "max":
            return self.grouped(s).amax(1)
        if rule == "sum":
            return self.grouped(s).sum(1)
        if rule == "relative":
            return self.grouped(relative).amax(1)
        if rule == "qnorm":
            return self.grouped(s / self.q.float().norm(dim=-1, keepdim=True)).amax(1)
        if rule == "share":
            return self.grouped(share).logsumexp(1)
        if rule == "share_max":
            return self.grouped(share).amax(1)
        if rule == "rank":
            rank = s.argsort(-1, descending=True).argsort(-1).float()
            best = self.grouped(rank).amin(1)
            # ranks are integers: relative scores below one order pages of equal best rank
            tie = self.grouped(relative).amax(1)
            return -best + torch.sigmoid(tie) * 0.5
        if rule == "per_head":
            return s
        if rule == "oracle":
            return self.grouped(self.mass).sum(1)
        raise ValueError(f"unknown rule {rule!r}")

    def picks(self, rule: str, budget_pages: int, policy: QuestPolicy) -> torch.Tensor:
        """[KVH or H, budget_pages] the pages `rule` reads, as QuestPolicy chooses them."""
        scores = self.rule_scores(rule).unsqueeze(0)
        n = torch.tensor([scores.shape[-1]], device=scores.device)
        indices, counts = select_pages(scores, n, budget_pages, policy.sink_pages,
                                       policy.recent_pages)
        return indices[0], counts[0]

    def recall(self, rule: str, budget_pages: int, policy: QuestPolicy) -> torch.Tensor:
        """[H] each query head's share of its attention in the pages read for it."""
        indices, counts = self.picks(rule, budget_pages, policy)
        if rule != "per_head":
            heads = torch.arange(self.scores.shape[0], device=indices.device) // self.group
            indices, counts = indices[heads], counts[heads]
        width = torch.arange(indices.shape[-1], device=indices.device)
        chosen = self.mass.gather(-1, indices.long()) * (width < counts.unsqueeze(-1))
        return chosen.sum(-1) + self.newest


def capture_queries(o) -> tuple[list[Query], KVLayout, dict]:
    model = o.model or smollm2()
    dtype = o.dtype or ("bfloat16" if o.device.startswith("cuda") else "float32")
    policy = QuestPolicy()
    queries, info = [], {"model": model.rsplit("/", 1)[-1], "dtype": dtype}
    tokenizer = load_tokenizer(model)
    prompts = []
    for task in filter(None, o.tasks.split(",")):
        trial = build_trial(tokenizer, task, o.context, o.depth, 0)
        answer = tokenizer(", ".join(trial.expected), add_special_tokens=False)["input_ids"]
        first = len(trial.prompt_ids) - 1                 # predicts the answer's first token
        picks = sorted({round(i * (len(answer) - 1) / max(1, o.queries - 1))
                        for i in range(min(o.queries, len(answer)))})
        prompts.append(([*trial.prompt_ids, *answer], [first + i for i in picks]))
    longest = max(len(ids) for ids, _ in prompts)
    with LLM(model, device=o.device, dtype=dtype, max_model_len=longest + 16,
             show_progress=False) as llm:
        model_dtype = llm.core.model.decoder.dtype
        for ids, positions in prompts:
            layers = capture(llm, ids)
            for layer, (q, k) in enumerate(layers):
                if layer < policy.dense_layers:
                    continue
                for t in positions:
                    queries.append(Query(layer, t, q[t].clone(), k, o.page_size))
                    queries[-1].keys = k            # for the engine's selection
            del layers
    q0, k0 = queries[0].q, queries[0].keys
    info.update(layers=max(x.layer for x in queries) + 1, heads=q0.shape[0],
                kv_heads=k0.shape[1], head_dim=q0.shape[1], queries=len(queries))
    blocks = -(-longest // o.page_size)
    layout = KVLayout(info["layers"], q0.shape[0], k0.shape[1], q0.shape[1], blocks, o.page_size,
                      model_dtype, torch.device(o.device), False, model_dtype, max_num_seqs=1)
    return queries, layout, info


def engine_jaccard(queries: list[Query], rule: str, budget: int, layout: KVLayout,
                   page: int) -> float:
    """Mean Jaccard index of the engine's selection (newest block included) against `picks`."""
    policy = QuestPolicy(budget_tokens=budget, page_size=page, gqa_reduce=rule)
    values, runtimes = [], {}
    for x in queries:
        key = (x.layer, id(x.keys))
        if key not in runtimes:
            runtimes[key] = policy.bind(layout)
            runtimes[key].on_kv_written(x.layer, x.keys,
                                        torch.arange(x.keys.shape[0], device=x.keys.device))
        ours = astream_quest_pages(runtimes[key], x.layer, x.q, x.t, page, layout.num_blocks)
        indices, counts = x.picks(rule, policy.budget_pages, policy)
        newest = set(range(x.t // page, -(-(x.t + 1) // page)))
        for h, got in enumerate(ours):
            want = set(indices[h, :counts[h]].tolist()) | newest
            values.append(len(got & want) / len(got | want))
        if len(runtimes) > 1:             # one layer's runtime at a time: bounds are large
            runtimes.pop(next(iter(runtimes)))
    return statistics.fmean(values)


def budgets_of(o) -> list[int]:
    out = []
    for item in o.budgets.split(","):
        value = float(item)
        tokens = int(value * o.context) if value <= 1 else int(value)
        out.append(max(tokens // o.page_size, 2) * o.page_size)
    return out


def cases(o) -> Iterator[tuple[dict, object]]:
    if o.smoke:
        o.context, o.tasks, o.queries = min(o.context, 512), "multivalue", 2
    rules = [r for r in o.rules.split(",") if r]
    unknown = set(rules) - set(RULES)
    if unknown:
        raise SystemExit(f"unknown rules {sorted(unknown)}; choose from {', '.join(RULES)}")
    with torch.inference_mode():
        queries, layout, info = capture_queries(o)
    for budget in budgets_of(o):
        for rule in rules:
            def run(rule=rule, budget=budget):
                policy = QuestPolicy(budget_tokens=budget, page_size=o.page_size)
                with torch.inference_mode():
                    recall = torch.cat([x.recall(rule, policy.budget_pages, policy)
                                        for x in queries]).tolist()
                    out = {"recall_mean": statistics.fmean(recall),
                           "recall_p10": percentile(recall, 10), "info": dict(info)}
                    if rule in ENGINE_RULES:
                        agreement = engine_jaccard(queries, rule, budget, layout, o.page_size)
                        out["engine_jaccard"] = agreement
                        out["ok"] = agreement >= 0.98
                return out
            yield {"rule": rule, "budget_tokens": budget, "context": o.context}, run


def summarize(result: dict) -> None:
    rows = result["rows"]
    budgets = sorted({r["params"]["budget_tokens"] for r in rows})
    print(f"\nattention-mass recall, mean / p10 ({rows[0]['info'].get('model')}, "
          f"context {rows[0]['params']['context']}, {rows[0]['info'].get('queries')} "
          "layer-queries)")
    print(f"{'rule':<12}" + "".join(f"{'budget ' + str(b):>22}" for b in budgets))
    for rule in dict.fromkeys(r["params"]["rule"] for r in rows):
        cells = []
        for b in budgets:
            row = next((r for r in rows if r["params"] == {**r["params"], "rule": rule,
                                                           "budget_tokens": b}), None)
            f = row["figures"] if row else {}
            cells.append(f"{f['recall_mean']['median']:.4f} / {f['recall_p10']['median']:.4f}"
                         if f else "-")
        print(f"{rule:<12}" + "".join(f"{c:>22}" for c in cells))
