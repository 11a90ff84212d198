"""Tensor parallelism inside the decoder: which slice of each weight a rank holds, and the
collectives that join the slices again.

Megatron's split. QKV and gate/up keep whole heads and whole intermediate rows
(column-parallel: split by output rows); o_proj and down keep the matching input columns
(row-parallel), so each rank's product is a partial sum that an all-reduce completes. The
embedding and the LM head are split by vocabulary rows, each shard padded to the same
length: the embedding's partial lookups are summed, the logits gathered.

With fewer KV heads than ranks, each KV head is replicated on size // num_kv_heads
neighbouring ranks, as vLLM does: rank r holds KV head r // (size // num_kv_heads), the
one its query heads read.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from astream.models.config import ModelConfig

_LAYER = re.compile(r"^model\.layers\.\d+\.(.+)$")
_ROWS = {"self_attn.q_proj.weight": "q", "self_attn.q_proj.bias": "q",
         "self_attn.k_proj.weight": "kv", "self_attn.k_proj.bias": "kv",
         "self_attn.v_proj.weight": "kv", "self_attn.v_proj.bias": "kv",
         "mlp.gate_proj.weight": "mlp", "mlp.up_proj.weight": "mlp"}
_COLUMNS = {"self_attn.o_proj.weight": "q", "mlp.down_proj.weight": "mlp"}
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
# The gather into one tensor (the ranks' parts one after the other): its newer name, else
# its older one.
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(slots=True, frozen=True)
class Slice:
    """Elements [start, stop) of dimension `dim`; `rows`: pad dimension 0 to this many."""

    dim: int
    start: int
    stop: int
    rows: int | None = None


@dataclass(slots=True, frozen=True)
class TPShard:
    """Rank `rank` of `size` over a model of shape `config` (the whole model's)."""

    rank: int
    size: int
    config: ModelConfig

    def __post_init__(self) -> None:
        check_tensor_parallel(self.config, self.size)

    @property
    def kv_heads(self) -> tuple[int, int]:
        """The first KV head this rank holds, and how many."""
        kv, size = self.config.num_kv_heads, self.size
        if kv >= size:
            return self.rank * (kv // size), kv // size
        return self.rank // (size // kv), 1

    @property
    def vocab_rows(self) -> int:
        """Rows of each vocabulary shard, the last one padded."""
        return -(-self.config.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    def local_config(self) -> ModelConfig:
        """The shape this rank's decoder computes: its heads and intermediate rows; the
        vocabulary and hidden size stay whole (logits are gathered, activations summed)."""
        c = self.config
        return dataclasses.replace(c, num_heads=c.num_heads // self.size,
                                   num_kv_heads=self.kv_heads[1],
                                   intermediate_size=c.intermediate_size // self.size)

    def slice_of(self, name: str) -> Slice | None:
        """The part of checkpoint tensor `name` this rank holds; None: the whole tensor."""
        c = self.config
        if name in _VOCAB:
            start = self.vocab_start
            return Slice(0, min(start, c.vocab_size), min(start + self.vocab_rows, c.vocab_size),
                         rows=self.vocab_rows)
        match = _LAYER.match(name)
        part = match and match.group(1)
        kind = _ROWS.get(part) or _COLUMNS.get(part)
        if kind is None:
            return None
        if kind == "q":
            width = c.num_heads // self.size * c.head_dim
            start = self.rank * width
        elif kind == "kv":
            first, count = self.kv_heads
            width, start = count * c.head_dim, first * c.head_dim
        else:
            width = c.intermediate_size // self.size
            start = self.rank * width
        return Slice(1 if part in _COLUMNS else 0, start, start + width)

    def take(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole checkpoint tensor (for formats read whole)."""
        where = self.slice_of(name)
        if where is None:
            return tensor
        return pad_rows(tensor.narrow(where.dim, where.start, where.stop - where.start), where)


def pad_rows(tensor: torch.Tensor, where: Slice) -> torch.Tensor:
    """A vocabulary shard padded with zero rows to the common shard length."""
    if where.rows is None or tensor.shape[0] == where.rows:
        return tensor.contiguous()
    padded = tensor.new_zeros((where.rows, *tensor.shape[1:]))
    padded[:tensor.shape[0]] = tensor
    return padded


def working_sizes(config: ModelConfig, limit: int | None = None) -> list[int]:
    """Tensor-parallel sizes this model's head counts and MLP width divide into."""
    return [n for n in range(1, (limit or config.num_heads) + 1) if _divides(config, n)]


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """ValueError, naming the sizes that work, unless the model splits over `size` ranks."""
    if _divides(config, size):
        return
    sizes = ", ".join(map(str, working_sizes(config)))
    raise ValueError(
        f"tensor_parallel_size {size} does not split this model: it has {config.num_heads} "
        f"attention heads, {config.num_kv_heads} KV heads and an MLP of "
        f"{config.intermediate_size}; sizes that work: {sizes}")


def _divides(config: ModelConfig, n: int) -> bool:
    kv = config.num_kv_heads
    return (config.num_heads % n == 0 and config.intermediate_size % n == 0
            and (kv % n == 0 or n % kv == 0))


@dataclass(slots=True)
class TensorParallel:
    """A rank's shard and the collectives over the engine's process group."""

    shard: TPShard
    group: object | None = None          # a torch.distributed group; None: the default one

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum in place over the ranks."""
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """[T, shard] logits of every rank, in the LM head's dtype -> float32 [T, vocab_size]
        on every rank (into `out` if given). They cross the ranks in the head's dtype, half
        the bytes of float32, and widen on the copy that puts each shard in its columns:
        the same values as widening first."""
        rows, shard = logits.shape
        if out is None:
            out = logits.new_empty((rows, vocab_size), dtype=torch.float32)
        if rows == 0:
            return out
        # One output tensor, not a list: no staging buffer and copies inside a CUDA graph.
        parts = logits.new_empty((self.size, rows, shard))
        _gather_into(parts.view(-1, shard), logits.contiguous(), group=self.group)
        for rank in range(self.size):
            start = rank * shard
            width = min(shard, vocab_size - start)
            out[:, start:start + width].copy_(parts[rank, :, :width])
        return out

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if tensor.numel():
            dist.broadcast(tensor, src, group=self.group)
        return tensor
