"""Quest decode kernels on a GPU: correctness against the torch references, then timings.

Run on the device:  python benchmarks/quest_kernels.py --out $OUT/quest_kernels.json
(--smoke: tiny shapes, also on CPU with the torch references; it only checks the script.)
bf16, the Qwen3-4B/8B attention shape (8 KV heads, 4 query heads each, head_dim 128), page 16.
Per (batch, context, budget): the share of the fused selection's pages (Triton) that the
torch reference did not pick (near-ties only), error of the selected-pages decode (Triton
vs torch in fp32) and timings with CUDA events (median) of the selection (Triton and
torch), selected decode and dense decode (Triton). Also: bounds maintenance exact,
all-pages selection == dense decode, a CUDA-graph replay of the whole Quest step, and
the page gather from a pinned host pool (zero-copy) and from device memory, in GB/s.
Error = max|x - ref| / max|ref|; exits 1 if any error >= 1e-2 or a check fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from astream.ops import quest  # noqa: E402
from astream.ops.backends import AttentionBackends  # noqa: E402
from astream.ops.quest_select import (  # noqa: E402
    physical_page_ids, select_decode_pages, select_decode_pages_ref,
)
from astream.runtime.pinned import PinnedHostTensor  # noqa: E402

KVH, GROUP, DIM, PAGE, BLOCK, HOST_BLOCK = 8, 4, 128, 16, 16, 256
ERR_LIMIT = 1e-2


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.float(), ref.float()
    ok = torch.isfinite(ref)
    if not torch.equal(ok, torch.isfinite(x)):
        return 1.0
    return ((x - ref)[ok].abs().max() / ref[ok].abs().max().clamp_min(1e-6)).item()


def time_ms(fn, reps: int) -> float:
    """Median of `reps` runs after warm-up: CUDA events on a GPU, wall time elsewhere."""
    for _ in range(3):
        fn()
    if not torch.cuda.is_available():
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) * 1e3 / reps
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for begin, end in events:
        begin.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(b.elapsed_time(e) for b, e in events)


def make_case(batch: int, ctx: int, dev: str, gen: torch.Generator) -> dict:
    """Shuffled paged bf16 caches of `batch` sequences of `ctx` tokens, and their bounds."""
    per_seq = -(-ctx // BLOCK)
    shape = (batch * per_seq, BLOCK, KVH, DIM)
    k = torch.randn(shape, device=dev, generator=gen).bfloat16()
    v = torch.randn(shape, device=dev, generator=gen).bfloat16()
    tables = torch.randperm(batch * per_seq, device=dev, generator=gen).view(batch, -1).int()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    kmin, kmax = quest.allocate_page_bounds(shape[0], BLOCK, KVH, DIM, dtype=k.dtype, device=dev)
    quest.store_block_bounds(kmin, kmax, k, torch.arange(shape[0], device=dev))
    ids, num = physical_page_ids(tables, lens, max_pages=per_seq * BLOCK // PAGE,
                                       block_size=BLOCK)
    q = torch.randn(batch, KVH * GROUP, DIM, device=dev, generator=gen).bfloat16()
    return dict(q=q, k=k, v=v, tables=tables, lens=lens, kmin=kmin, kmax=kmax, ids=ids, num=num)


def select(c: dict, budget: int, fn=select_decode_pages):
    return fn(c["q"], c["kmin"], c["kmax"], c["tables"], c["lens"], max_pages=c["ids"].shape[1],
              block_size=BLOCK, page_size=PAGE, budget_pages=budget)


def quest_step(c: dict, budget: int):
    """Selection -> selected decode: one layer's Quest decode."""
    pages, counts, _ = select(c, budget)
    return quest.paged_decode_selected(c["q"], c["k"], c["v"], c["tables"], pages, counts,
                                       c["lens"], page_size=PAGE, scale=DIM ** -0.5)


def mismatch(got, want) -> float:
    """Share of picked pages one selection has and the other has not."""
    differ = total = 0
    for b, h in ((b, h) for b in range(got.counts.shape[0]) for h in range(got.counts.shape[1])):
        n = int(got.counts[b, h])
        mine, theirs = set(got.indices[b, h, :n].tolist()), set(want.indices[b, h, :n].tolist())
        differ, total = differ + len(mine - theirs), total + n
    return differ / max(total, 1)


def sweep_row(c: dict, budget: int, reps: int) -> dict:
    q, ids = c["q"], c["ids"]
    chosen = select(c, budget)
    args = (q, c["k"], c["v"], c["tables"], chosen.indices, chosen.counts, c["lens"])
    kw = dict(page_size=PAGE, scale=DIM ** -0.5)
    out, lse = quest.paged_decode_selected(*args, **kw)
    ref_out, ref_lse = quest.paged_decode_selected_ref(q.float(), *args[1:], **kw)
    max_ctx = ids.shape[1] * PAGE
    backends = AttentionBackends.select(q.device, q.dtype, DIM)
    dense = lambda: backends.paged_decode(  # noqa: E731
        q, c["k"], c["v"], c["tables"], c["lens"], scale=DIM ** -0.5, max_context_len=max_ctx)
    return {"select_mismatch": mismatch(chosen, select(c, budget, select_decode_pages_ref)),
            "err_out": rel_err(out, ref_out), "err_lse": rel_err(lse, ref_lse),
            "select_us": 1e3 * time_ms(lambda: select(c, budget), reps),
            "select_ref_us": 1e3 * time_ms(lambda: select(c, budget, select_decode_pages_ref), reps),
            "selected_us": 1e3 * time_ms(lambda: quest.paged_decode_selected(*args, **kw), reps),
            "step_us": 1e3 * time_ms(lambda: quest_step(c, budget), reps),
            "dense_us": 1e3 * time_ms(dense, reps)}


def full_selection_check(c: dict) -> float:
    """A budget covering the context: the Quest step must equal dense decode."""
    n_pages = c["ids"].shape[1]
    out, lse = quest_step(c, n_pages)
    backends = AttentionBackends.select(c["q"].device, c["q"].dtype, DIM)
    ref = backends.paged_decode(c["q"], c["k"], c["v"], c["tables"], c["lens"],
                                scale=DIM ** -0.5, max_context_len=n_pages * PAGE)
    return max(rel_err(out, ref[0]), rel_err(lse, ref[1]))


def bounds_check(dev: str, gen: torch.Generator) -> bool:
    """Prefill in chunks then decode tokens through update_page_bounds == whole-block bounds."""
    blocks, n_tok = 64, 64 * BLOCK - 5
    keys = torch.randn(blocks * BLOCK, KVH, DIM, device=dev, generator=gen).bfloat16()
    kmin, kmax = quest.allocate_page_bounds(blocks, BLOCK, KVH, DIM, dtype=keys.dtype, device=dev)
    slots = torch.randperm(blocks, device=dev, generator=gen).repeat_interleave(BLOCK) * BLOCK \
        + torch.arange(BLOCK, device=dev).repeat(blocks)
    for lo, hi in ((0, 300), (300, n_tok - 40)):
        quest.update_page_bounds(kmin, kmax, keys[lo:hi], slots[lo:hi])
    for t in range(n_tok - 40, n_tok):
        quest.update_page_bounds(kmin, kmax, keys[t:t + 1], slots[t:t + 1])
    cache = torch.zeros(blocks * BLOCK, KVH, DIM, device=dev, dtype=keys.dtype)
    cache[slots[:n_tok]] = keys[:n_tok]
    valid = torch.zeros(blocks * BLOCK, dtype=torch.int64, device=dev)
    valid[slots[:n_tok]] = 1
    per_block = valid.view(blocks, BLOCK).sum(1)
    lo, hi = quest.bounds_of_blocks(cache.view(blocks, BLOCK, KVH, DIM), PAGE, per_block)
    return bool(torch.equal(lo, kmin) and torch.equal(hi, kmax))


def graph_check(c: dict, budget: int) -> float:
    """Capture the Quest step in a CUDA graph, shorten the contexts, replay, compare."""
    quest_step(c, budget)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = quest_step(c, budget)
    new_lens = (c["lens"] // 3 + torch.arange(len(c["lens"]), device="cuda")).int()
    c["lens"].copy_(new_lens)
    c["num"].copy_((new_lens + PAGE - 1) // PAGE)
    graph.replay()
    ref_out, ref_lse = quest_step(c, budget)
    return max(rel_err(out, ref_out), rel_err(lse, ref_lse))


def gather_rows(batch: int, budgets: list[int], host_blocks: int, reps: int, dev: str,
                gen: torch.Generator) -> list[dict]:
    """Zero-copy page gather from a pinned head-major host pool, and from device memory."""
    shape = (2, host_blocks, KVH, HOST_BLOCK, DIM)
    pool = PinnedHostTensor(shape, torch.bfloat16, pin=dev == "cuda")
    pool.tensor.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(0)))
    sources = {"pinned_host": pool.tensor, "device": pool.tensor.to(dev)}
    rows = []
    for budget in budgets:
        n_pages = host_blocks * HOST_BLOCK // PAGE
        page_src = torch.randint(0, n_pages, (batch, KVH, budget), device=dev, generator=gen)
        counts = torch.full((batch, KVH), budget, dtype=torch.int32, device=dev)
        dst = torch.empty(2, batch, KVH, budget * PAGE, DIM, dtype=torch.bfloat16, device=dev)
        want = torch.empty_like(dst)
        quest.gather_pages_ref(sources["device"][0], sources["device"][1], page_src, *want, counts)
        for where, src in sources.items():
            row = {"source": where, "batch": batch, "budget_pages": budget}
            run = lambda: quest.gather_pages(src[0], src[1], page_src, *dst, counts)  # noqa: E731
            try:
                dst.zero_()
                run()
                ms = time_ms(run, reps)
            except Exception as exc:  # e.g. Triton refusing a host pointer: report, go on
                rows.append({**row, "exact": False, "us": 0.0, "gbps": 0.0, "error": repr(exc)})
                continue
            rows.append({**row, "exact": bool(torch.equal(dst, want)), "us": ms * 1e3,
                         "gbps": dst.numel() * dst.element_size() / (ms * 1e-3) / 1e9})
    pool.release()
    return rows


def print_tables(r: dict) -> None:
    print(f"\nbounds exact: {r['bounds_exact']}  all-pages == dense: {r['full_err']:.1e}  "
          f"graph replay: {r['graph_err']:.1e}")
    print("\nQuest decode, bf16, KVH=8, G=4, D=128, page 16; median us per layer")
    print(f"{'B':>3}{'ctx':>8}{'budget':>7}{'sel_diff':>9}{'err_out':>9}{'err_lse':>9}"
          f"{'select':>8}{'sel_ref':>8}{'sel_dec':>8}{'step':>8}{'dense':>8}")
    for x in r["decode"]:
        print(f"{x['batch']:>3}{x['ctx']:>8}{x['budget']:>7}{x['select_mismatch']:>9.1e}"
              f"{x['err_out']:>9.1e}{x['err_lse']:>9.1e}{x['select_us']:>8.0f}"
              f"{x['select_ref_us']:>8.0f}{x['selected_us']:>8.0f}"
              f"{x['step_us']:>8.0f}{x['dense_us']:>8.0f}")
    print("\npage gather (K and V pages, 4 KB each) into dense device buffers")
    for x in r["gather"]:
        print(f"  {x['source']:<12} B={x['batch']} budget={x['budget_pages']:>5} pages  "
              f"exact={x['exact']}  {x['us']:>8.0f} us  {x['gbps']:>6.1f} GB/s  "
              f"{x.get('error', '')}")
    print(f"\nmax error {r['max_err']:.2e} (limit {ERR_LIMIT}) -> {'OK' if r['ok'] else 'FAIL'}; "
          f"{r['seconds']:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/quest_kernels.json"))
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU too")
    args = parser.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and not args.smoke:
        print("needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    contexts, batches, budgets = ([4096, 32768, 131072], [1, 4], [64, 256, 1024]) \
        if not args.smoke else ([100, 300], [2], [4, 8])
    gen = torch.Generator(device=dev).manual_seed(0)
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    start, result = time.time(), {"device": name, "torch": torch.__version__, "decode": []}
    result["bounds_exact"] = bounds_check(dev, gen)
    for batch in batches:
        for ctx in contexts:
            case = make_case(batch, ctx, dev, gen)
            for budget in budgets:
                row = {"batch": batch, "ctx": ctx, "budget": budget}
                result["decode"].append({**row, **sweep_row(case, budget, args.reps)})
            del case
    result["full_err"] = full_selection_check(make_case(2, contexts[-1] // 2, dev, gen))
    result["graph_err"] = graph_check(make_case(4, contexts[1], dev, gen), budgets[-1]) \
        if dev == "cuda" else 0.0
    result["gather"] = gather_rows(batches[-1], budgets, 512 if not args.smoke else 4,
                                   args.reps, dev, gen)
    errors = [x[k] for x in result["decode"] for k in ("select_mismatch", "err_out", "err_lse")]
    result["max_err"] = max(errors + [result["full_err"], result["graph_err"]])
    result["ok"] = (result["max_err"] < ERR_LIMIT and result["bounds_exact"]
                    and all(x["exact"] for x in result["gather"]))
    result["seconds"] = time.time() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print_tables(result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
