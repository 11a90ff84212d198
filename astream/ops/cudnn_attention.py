"""Long prefill attention through cuDNN's fused attention (torch's private SDPA op).

On Hopper, cuDNN's attention runs prefill-sized problems well above the FlashAttention-2
kernels torch bundles (measured in docs/BENCHMARKS.md), and returns the lse the engine
merges by. It serves one sequence at a time in dense [1, H, T, D] form, which is a strided
view of the packed [T, H, D] rows, so nothing is copied. K/V may have fewer heads (GQA).

cuDNN's causal mask is top-left aligned, the engine's bottom-right (a chunk sees its whole
prefix), so a chunk after a prefix is two problems merged by lse: the chunk over the
prefix without a mask, and the causal square of the chunk over itself.

cuDNN builds an execution plan for every new problem shape, 70 ms to over a second on the
H100, and keeps it for the process. Chunks of any length over prefixes of any length would
build plans for as long as a server runs, each one stalling the step that meets it. So a
problem is cut along a `ShapeLadder`: queries into blocks, keys into pieces, of power-of-two
lengths, and the parts are merged by lse. The shapes are then few and known before the first
request (`ShapeLadder.shapes`), and the engine builds their plans at startup (`warm_up`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from astream.ops.varlen import VarlenMeta

# cuDNN's fused attention is fastest on Hopper; on Ampere and Blackwell the FlashAttention
# kernels match or beat it, so only sm90 takes this path.
CUDNN_CAPABILITY_MAJOR = 9
CUDNN_MAX_HEAD_DIM = 128

DenseFn = Callable[..., tuple[Tensor, Tensor]]
MergeFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
PartFn = Callable[[Tensor, Tensor, Tensor, VarlenMeta], tuple[Tensor, Tensor]]


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cudnn_attention_available(device: torch.device, head_dim: int) -> bool:
    """True on a Hopper GPU whose torch build carries cuDNN attention and has it enabled."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        return False
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return (_capability(index)[0] == CUDNN_CAPABILITY_MAJOR and head_dim % 8 == 0
            and head_dim <= CUDNN_MAX_HEAD_DIM)


def cudnn_dense(q: Tensor, k: Tensor, v: Tensor, *, causal: bool,
                scale: float) -> tuple[Tensor, Tensor]:
    """One sequence: q [Tq, H, D], k/v [Tk, KVH, D] -> out [Tq, H, D], lse [Tq, H] float32.

    causal is top-left aligned (query i sees keys j <= i); the callers pass Tq == Tk.
    """
    # Strides are part of a plan's key: rows of a packed tensor are laid out alike, but a
    # first chunk's v is a view into the QKV projection, so a copy keeps its plan the one
    # `warm_up` built (each call copies its keys' v: tens of MB for a 16K chunk, against
    # attention work of seconds' worth of bandwidth).
    heads_first = [x.contiguous().unsqueeze(0).transpose(1, 2) for x in (q, k, v)]
    result = torch.ops.aten._scaled_dot_product_cudnn_attention(
        *heads_first, None, True, 0.0, causal, False, scale=scale)
    out = result[0].transpose(1, 2).squeeze(0)
    lse = result[1].reshape(q.shape[1], q.shape[0]).t()
    return out, lse


@dataclass(slots=True, frozen=True)
class ShapeLadder:
    """The lengths cuDNN sees: powers of two from `step` up to `max_queries` (query blocks)
    and `max_keys` (key pieces); a length that is not a multiple of `step` keeps its ragged
    rest as one more part (never the case for what `takes_cudnn` routes here)."""

    step: int = 1024
    max_queries: int = 16384
    max_keys: int = 65536

    def query_blocks(self, n: int) -> list[int]:
        return _powers_of_two(n, self.step, self.max_queries)

    def key_pieces(self, n: int) -> list[int]:
        return _powers_of_two(n, self.step, self.max_keys)

    def shapes(self, max_queries: int, max_keys: int) -> list[tuple[int, int, bool]]:
        """Every (queries, keys, causal) a chunk of at most max_queries rows over at most
        max_keys keys can meet: causal squares of each block, and each block over each piece."""
        blocks = _ladder(self.step, min(self.max_queries, max_queries))
        pieces = _ladder(self.step, min(self.max_keys, max_keys))
        return [(b, b, True) for b in blocks] + [(b, p, False) for b in blocks for p in pieces]


LADDER = ShapeLadder()


def _ladder(smallest: int, largest: int) -> list[int]:
    sizes, size = [], smallest
    while size <= largest:
        sizes.append(size)
        size *= 2
    return sizes


def _powers_of_two(n: int, smallest: int, largest: int) -> list[int]:
    """n as parts of the ladder, largest first: 7168 -> [4096, 2048, 1024] (1024 to 8192)."""
    parts, sizes = [], _ladder(smallest, largest)[::-1]
    for size in sizes:
        while n >= size:
            parts.append(size)
            n -= size
    if n:
        parts.append(n)
    return parts


def one_sequence(dense: DenseFn, merge: MergeFn, q: Tensor, k: Tensor, v: Tensor, *,
                 causal: bool, scale: float,
                 ladder: ShapeLadder = LADDER) -> tuple[Tensor, Tensor]:
    """Varlen semantics for one sequence (causal bottom-right aligned) from a dense kernel
    whose causal mask is top-left aligned, on the ladder's shapes only: each query block is
    the causal square over its own rows plus unmasked pieces of everything before them."""
    n_q, n_k = q.shape[0], k.shape[0]
    if causal and n_k < n_q:
        raise ValueError(f"causal attention of {n_q} queries over {n_k} keys: "
                         "the first queries would see no key")
    blocks = ladder.query_blocks(n_q)
    if len(blocks) == 1:
        return _one_block(dense, merge, q, k, v, n_k - n_q, causal, scale, ladder)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    start = 0
    for size in blocks:
        end = start + size
        # A block sees what the whole chunk's prefix sees plus the chunk's rows before it.
        keys = n_k - n_q + end if causal else n_k
        out[start:end], lse[start:end] = _one_block(dense, merge, q[start:end], k[:keys],
                                                    v[:keys], keys - size, causal, scale, ladder)
        start = end
    return out, lse


def _one_block(dense: DenseFn, merge: MergeFn, q: Tensor, k: Tensor, v: Tensor, prefix: int,
               causal: bool, scale: float, ladder: ShapeLadder) -> tuple[Tensor, Tensor]:
    """One query block: its causal square (the last len(q) keys) and unmasked key pieces
    of the `prefix` keys before it; without causal, unmasked pieces of every key."""
    parts, rows = [], None
    if causal:
        parts.append(dense(q, k[prefix:], v[prefix:], causal=True, scale=scale))
    else:
        prefix = k.shape[0]
    start = 0
    for size in ladder.key_pieces(prefix):
        parts.append(dense(q, k[start:start + size], v[start:start + size], causal=False,
                           scale=scale))
        start += size
    out, lse = parts[0]
    for part_out, part_lse in parts[1:]:
        rows = torch.arange(q.shape[0], device=q.device) if rows is None else rows
        out, lse = merge(out, lse.contiguous(), rows, part_out, part_lse)
    return out, lse


def warm_up(dense: DenseFn, merge: MergeFn, max_queries: int, max_keys: int, heads: int,
            kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, scale: float,
            ladder: ShapeLadder = LADDER) -> int:
    """Build the plan of every shape the ladder gives chunks of at most max_queries rows over
    at most max_keys keys, on zeros laid out as the engine's rows are, and run the merge once
    (a Triton kernel compiles at its first call); returns how many shapes."""
    shapes = ladder.shapes(max_queries, max_keys)
    if not shapes:
        return 0
    longest_q = max(s[0] for s in shapes)
    longest_k = max(s[1] for s in shapes)
    q = torch.zeros(longest_q, heads, head_dim, dtype=dtype, device=device)
    k = torch.zeros(longest_k, kv_heads, head_dim, dtype=dtype, device=device)
    for n_q, n_k, causal in shapes:
        dense(q[:n_q], k[:n_k], k[:n_k], causal=causal, scale=scale)
    if ladder.step * 2 <= longest_k:
        one_sequence(dense, merge, q[:ladder.step], k[:2 * ladder.step], k[:2 * ladder.step],
                     causal=True, scale=scale, ladder=ladder)
    return len(shapes)


def by_sequence(long_part: PartFn, short_part: PartFn, q: Tensor, k: Tensor, v: Tensor,
                meta: VarlenMeta, *, takes_long: Callable[[int, int], bool]) -> tuple[Tensor, Tensor]:
    """A packed batch one sequence at a time: sequences whose (queries, keys) `takes_long`
    accepts through long_part, the others through short_part, each given its rows and a
    one-sequence meta (device offsets sliced from the batch's, so nothing waits on a copy)."""
    cu_q, cu_k = meta.host_cu_seqlens_q, meta.host_cu_seqlens_k
    if len(cu_q) == 2:
        part = long_part if takes_long(cu_q[1], cu_k[1]) else short_part
        return part(q, k[:cu_k[1]], v[:cu_k[1]], meta)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        one = VarlenMeta(meta.cu_seqlens_q[s:s + 2] - meta.cu_seqlens_q[s],
                         meta.cu_seqlens_k[s:s + 2] - meta.cu_seqlens_k[s],
                         q1 - q0, k1 - k0, [0, q1 - q0], [0, k1 - k0])
        part = long_part if takes_long(q1 - q0, k1 - k0) else short_part
        out[q0:q1], lse[q0:q1] = part(q[q0:q1], k[k0:k1], v[k0:k1], one)
    return out, lse
