"""Quest's offloaded decode read of one layer, two ways: the selected pages gathered from the
pinned host pool into a device buffer and attended there (what the engine runs), against
the attention kernel reading the same pages in place from the host pool. Both read host
memory from a kernel (zero-copy); the second saves the buffer's write and read and one launch.

    python benchmarks/run.py page_gather [--kv-heads 8,4] [--repeats 3]
    python benchmarks/run.py page_gather --smoke          # CPU, the torch references

One sequence of --context [131072] tokens in 16-token blocks, --budget [4096] tokens chosen
per KV head (pages of --page-size [16], random and ascending, the same for both ways),
4 query heads per KV head of 128 dims, bf16. Each way runs --layers [34] times in one CUDA
graph (34: the Qwen3-8B/4B shapes' sparse layers) replayed 5 times a repeat; figures are
microseconds a layer and the rate of the bytes read (keys and values of the chosen pages).
Each row checks that both ways give the same attention output and log-sum-exp.
"""

from __future__ import annotations

from functools import partial

import torch

from quest import graph_us, wall_us  # noqa: I001
from astream.executor.offload_attention import gathered_view
from astream.ops.pages import gather_pages, paged_decode_selected, physical_pages
from astream.runtime.pinned import PinnedHostTensor

HEAD_DIM, GROUP, BLOCK = 128, 4, 16
REPLAYS = 5


def add_arguments(parser) -> None:
    parser.add_argument("--kv-heads", default=None, help="KV heads a rank reads [8,4]")
    parser.add_argument("--context", type=int, default=None, help="tokens in the host pool [131072]")
    parser.add_argument("--budget", type=int, default=None, help="tokens chosen per KV head [4096]")
    parser.add_argument("--page-size", type=int, default=16, help="tokens a page [16]")
    parser.add_argument("--layers", type=int, default=None, help="reads per graph [34]")


def cases(o):
    smoke = o.smoke or o.device == "cpu"
    o.kv_heads = o.kv_heads or ("2" if smoke else "8,4")
    o.context = o.context or (1024 if smoke else 131072)
    o.budget = o.budget or (128 if smoke else 4096)
    o.layers = o.layers or (2 if smoke else 34)
    for heads in (int(h) for h in o.kv_heads.split(",")):
        yield ({"kv_heads": heads, "context": o.context, "budget": o.budget,
                "page_size": o.page_size}, partial(read_row, o, heads))


def read_row(o, kv_heads: int) -> dict:
    device = torch.device(o.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    blocks, pages = o.context // BLOCK, o.budget // o.page_size
    pool = PinnedHostTensor((2, blocks, kv_heads, BLOCK, HEAD_DIM), dtype, device.type == "cuda")
    try:
        host_k, host_v = pool.tensor.normal_().unbind(0)
        gen = torch.Generator().manual_seed(kv_heads)
        tables = torch.randperm(blocks, generator=gen).to(torch.int32).view(1, blocks).to(device)
        per_block = BLOCK // o.page_size
        chosen = torch.stack([torch.randperm(blocks * per_block, generator=gen)[:pages].sort().values
                              for _ in range(kv_heads)]).view(1, kv_heads, pages).to(device)
        physical = physical_pages(chosen, tables, BLOCK, o.page_size)
        counts = torch.full((1, kv_heads), pages, dtype=torch.int32, device=device)
        q = torch.randn(1, kv_heads * GROUP, HEAD_DIM, device=device, dtype=dtype)
        gathered = [torch.empty(1, kv_heads, pages * o.page_size, HEAD_DIM, device=device, dtype=dtype)
                    for _ in range(2)]
        own_block, in_order, every_token = gathered_view(1, kv_heads, pages, pages * o.page_size,
                                                         device)
        lens = torch.full((1,), o.context, dtype=torch.int32, device=device)
        scale = HEAD_DIM ** -0.5

        def gather_then_attend():
            gather_pages(host_k, host_v, physical, *gathered, counts, None, o.page_size)
            dk, dv = (t.transpose(1, 2) for t in gathered)
            return paged_decode_selected(q, dk, dv, own_block, in_order, counts, every_token,
                                         page_size=o.page_size, scale=scale)

        def attend_in_place():
            return paged_decode_selected(q, host_k.transpose(1, 2), host_v.transpose(1, 2), tables,
                                         chosen.to(torch.int32), counts, lens,
                                         page_size=o.page_size, scale=scale)

        (out_a, lse_a), (out_b, lse_b) = gather_then_attend(), attend_in_place()
        out_diff = (out_a.float() - out_b.float()).abs().max().item()
        lse_diff = (lse_a - lse_b).abs().max().item()
        read_bytes = 2 * kv_heads * pages * o.page_size * HEAD_DIM * dtype.itemsize
        figures: dict = {}
        for name, fn in (("gathered", gather_then_attend), ("in_place", attend_in_place)):
            us = graph_us(fn, REPLAYS, o.layers) if device.type == "cuda" else wall_us(fn, REPLAYS)
            figures[f"{name}_us"] = us
            figures[f"{name}_gb_s"] = [round(read_bytes / t / 1e3, 2) for t in us]
        return {**figures, "info": {"ok": out_diff < 1e-2 and lse_diff < 1e-3,
                                    "out_diff": out_diff, "lse_diff": lse_diff,
                                    "bytes_per_layer": read_bytes}}
    finally:
        pool.release()

