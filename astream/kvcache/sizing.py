"""How many KV blocks fit, and what max_model_len and token budget follow from it.

Without offload the blocks live on the device and fill the memory the weights
leave. With offload they live in host memory, and the device keeps only a ring
of layer buffers, a staging buffer for new KV and one tail block per sequence.
Every plan says where its memory goes (`MemoryPlan`), from shapes alone: planning
allocates nothing, and given the memory there is (`MemoryAvailable`) it runs on any
machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from astream.kvcache.context_loads import CONTEXT_STAGE_BLOCKS
from astream.models.config import ModelConfig
from astream.ops.backends import CUDNN_SHAPE_STEP

_MiB, _GiB = 2**20, 2**30
_SLOT_TOKENS = 65536
HOST_RESERVE = 8 * _GiB        # host memory an explicit max_model_len's pool leaves at least
# The decode graphs' sampling, per captured row and vocabulary entry (executor.sampling_tail):
# its static tables (the step's float32 logits and output-token counts, its bool prompt and
# banned-token masks), and what its captured programs keep in the graphs' pool beyond the
# activation reserve's logits (sorted logits and their order, the processed, scaled and
# filtered logits, probabilities and their cumulative mass). Measured on an H200 with a
# 151,936-token vocabulary, the sampling tail's pool grew 27-39 bytes a row and entry at 256
# to 64 rows (more at fewer rows, where it is a few MiB): benchmarks/graph_sampling_check.py.
SAMPLING_TABLE_BYTES = 4 + 4 + 1 + 1
SAMPLING_WORKSPACE_BYTES = 40


@dataclass(slots=True, frozen=True)
class CacheSpec:
    """What the cache is asked to be; None means "derive it from the memory there is"."""

    block_size: int
    max_num_seqs: int
    offload: bool
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.85
    cpu_kv_cache_gib: float = 1.0
    offload_host_gib: float | None = None
    offload_ring_slots: int = 3
    offload_slot_tokens: int | None = None
    kv_overhead: float = 0.0        # device bytes of policy metadata per byte of KV in the cache
    device_layers: int = 0          # with offload: layers whose KV the device keeps a copy of
    device_key_layers: int = 0      # with offload: layers whose keys the device keeps a copy of
    whole_prefix: bool = False      # with offload: prefill loads a chunk's whole prefix per layer
    device_reserve_bytes: int = 0   # with offload: device buffers the policy keeps (page reuse)
    decode_scratch_bytes: int = 0   # transient: what a decode step's selection holds (Quest's scores)
    prefill_chunk_tokens: int = 0   # the chunk the sparse prefill method estimates best in (0: any)
    host_ranks: int = 1             # with offload: processes pinning a pool in this host's RAM
    graph_sampling_rows: int = 0    # rows of the decode graphs' sampling tables (0: none kept)


@dataclass(slots=True, frozen=True)
class OffloadPlan:
    num_slots: int                 # ring slots (layer buffers) on the device
    slot_blocks: int               # KV blocks one slot holds
    staging_blocks: int            # blocks of new KV one layer can stage for D2H


@dataclass(slots=True, frozen=True)
class MemoryAvailable:
    """The memory a plan may use, in bytes: measured when not given (device figures on CUDA
    only), given to plan for another machine without touching one."""

    device_free: int = 0
    device_total: int = 0
    host: int = 0

    @classmethod
    def measure(cls, device: torch.device) -> "MemoryAvailable":
        free, total = torch.cuda.mem_get_info(device) if device.type == "cuda" else (0, 0)
        return cls(free, total, _host_available_bytes())


# MemoryPlan's device fields, in the order the start-up line shows them; the device total is their sum.
DEVICE_PARTS = ("weights", "device_kv", "device_keys", "ring", "staging", "tails", "policy_metadata",
                "decode_buffers", "decode_scratch", "prefix_buffers", "prefill_context",
                "graph_sampling", "activations")


@dataclass(slots=True, frozen=True)
class MemoryPlan:
    """Where a cache plan's memory goes, in bytes (docs/ENGINE.md, "Memory plan").

    Host: the KV pool (offload). Device: the weights (dense, in the model's dtype), the KV
    kept there (the whole cache, or with offload the device layers' copy), with offload the
    keys of the layers whose pages are gathered with keys from the device, the offload
    buffers (ring, staging, tails), the policy's metadata (Quest's page and group bounds),
    its decode buffers, what its decode selection holds at once (Quest's page scores),
    packed prefixes (sparse prefill with offload), the largest context a prefill step
    dequantizes at once (with offload: a ring slot, or a device layer's whole context, in the
    model's dtype), the decode graphs' sampling tables and workspace, and the reserve for one
    step's activations.
    """

    host_pool: int = 0
    weights: int = 0
    device_kv: int = 0
    device_keys: int = 0
    ring: int = 0
    staging: int = 0
    tails: int = 0
    policy_metadata: int = 0
    decode_buffers: int = 0
    decode_scratch: int = 0
    prefix_buffers: int = 0
    prefill_context: int = 0
    graph_sampling: int = 0
    activations: int = 0

    @property
    def device_total(self) -> int:
        return sum(getattr(self, name) for name in DEVICE_PARTS)

    def describe(self) -> str:
        """One line: host pool, device total, and each device part, in GiB."""
        shown = ", ".join(f"{name} {getattr(self, name) / _GiB:.2f}" for name in DEVICE_PARTS
                          if getattr(self, name))
        return (f"host pinned {self.host_pool / _GiB:.2f} GiB, device {self.device_total / _GiB:.2f} "
                f"GiB ({shown})")


@dataclass(slots=True, frozen=True)
class CachePlan:
    num_blocks: int                # KV blocks in the cache (host pool when offloading)
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    offload: OffloadPlan | None = None
    memory: MemoryPlan = MemoryPlan()


def plan_cache(cfg: CacheSpec, model: ModelConfig, dtype: torch.dtype, device: torch.device,
               kv_dtype: torch.dtype | None = None,
               available: MemoryAvailable | None = None) -> CachePlan:
    """`dtype` is the model's, `kv_dtype` the cache's (default: the model's). `available`:
    the memory to plan with (default: measured here; the device's free bytes then count
    the weights already loaded as used)."""
    check_max_model_len(cfg.max_model_len, model)
    block = cfg.block_size
    max_len = cfg.max_model_len or model.max_position_embeddings
    budget = max(cfg.max_num_batched_tokens or _default_budget(cfg, device, max_len), cfg.max_num_seqs)
    kv_dtype = kv_dtype or dtype
    block_bytes = model.kv_bytes_per_token * block * _element_size(kv_dtype)
    if cfg.offload:
        budget = max(budget, cfg.max_num_seqs + block)     # room for a whole block after decodes
        blocks = cfg.num_kv_blocks or _host_blocks(cfg, max_len, block, block_bytes, available)
    else:
        blocks = cfg.num_kv_blocks or _device_blocks(cfg, model, dtype, device, budget,
                                                     int(block_bytes * (1 + cfg.kv_overhead)),
                                                     available)
    max_len = _fit_max_len(cfg, blocks, block, max_len, "host KV pool" if cfg.offload else "KV cache")
    metadata = int(blocks * block_bytes * cfg.kv_overhead)
    offload = None
    if cfg.offload:     # the policy's metadata of the host pool's blocks lives on the device
        mirrored = sum(_device_copies(cfg, block_bytes // model.num_layers, blocks))
        offload = _plan_offload(cfg, model, dtype, device, budget, max_len, metadata + mirrored,
                                kv_dtype, available)
    memory = memory_plan(cfg, model, dtype, kv_dtype, blocks, budget, max_len, offload)
    return CachePlan(blocks, block, max_len, budget, offload, memory)


def memory_plan(cfg: CacheSpec, model: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype,
                blocks: int, budget: int, max_len: int, offload: OffloadPlan | None) -> MemoryPlan:
    """The bytes of a plan's parts (the formula in docs/ENGINE.md, "Memory plan")."""
    block_bytes = model.kv_bytes_per_token * cfg.block_size * _element_size(kv_dtype)
    layer_block_bytes = block_bytes // model.num_layers
    common = dict(weights=weight_bytes(model, dtype),
                  policy_metadata=int(blocks * block_bytes * cfg.kv_overhead),
                  graph_sampling=graph_sampling_bytes(cfg.graph_sampling_rows, model.vocab_size),
                  decode_scratch=cfg.decode_scratch_bytes,
                  activations=_activation_bytes(model, budget, cfg.max_num_seqs, dtype))
    if offload is None:
        return MemoryPlan(device_kv=blocks * block_bytes, **common)
    prefix = 0
    packed = layer_block_bytes * _element_size(dtype) // _element_size(kv_dtype)
    if cfg.whole_prefix:
        prefix = 2 * -(-max_len // cfg.block_size) * packed + CONTEXT_STAGE_BLOCKS * layer_block_bytes
    context = max(offload.slot_blocks * packed,
                  _device_layer_context(cfg, max_len, layer_block_bytes, packed))
    device_kv, device_keys = _device_copies(cfg, layer_block_bytes, blocks)
    return MemoryPlan(
        host_pool=blocks * block_bytes, device_kv=device_kv, device_keys=device_keys,
        ring=offload.num_slots * offload.slot_blocks * layer_block_bytes,
        staging=2 * offload.staging_blocks * layer_block_bytes,
        tails=model.num_layers * (cfg.max_num_seqs + 1) * layer_block_bytes,
        decode_buffers=cfg.device_reserve_bytes, prefix_buffers=prefix, prefill_context=context,
        **common)


def _device_copies(cfg: CacheSpec, layer_block_bytes: int, blocks: int) -> tuple[int, int]:
    """With offload, the device's copies of the host pool's `blocks`: the whole KV of the
    layers it keeps (`device_layers`), and the keys of the layers it keeps keys of."""
    return (cfg.device_layers * blocks * layer_block_bytes,
            cfg.device_key_layers * blocks * (layer_block_bytes // 2))


def graph_sampling_bytes(rows: int, vocab_size: int) -> int:
    """Device bytes of the decode graphs' sampling over `rows` rows: tables and workspace."""
    return rows * vocab_size * (SAMPLING_TABLE_BYTES + SAMPLING_WORKSPACE_BYTES)


def _device_layer_context(cfg: CacheSpec, max_len: int, layer_block_bytes: int, packed: int) -> int:
    """A device layer's whole context, gathered for a prefill chunk that continues a prefix:
    the stored rows, and their dequantized copy when the cache holds another dtype."""
    if not cfg.device_layers:
        return 0
    stored = layer_block_bytes if packed != layer_block_bytes else 0
    return -(-max_len // cfg.block_size) * (packed + stored)


def weight_bytes(model: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the model's weights held densely in `dtype`, with the rotary tables (cos and
    sin of every position up to max_position_embeddings: 512 MiB at a million)."""
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    hidden = model.hidden_size
    layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * model.intermediate_size + 2 * hidden
    if model.qkv_bias:
        layer += q + 2 * kv
    if model.qk_norm:
        layer += 2 * model.head_dim
    embeddings = model.vocab_size * hidden * (1 if model.tie_word_embeddings else 2)
    rope = 2 * model.max_position_embeddings * model.head_dim
    return (model.num_layers * layer + embeddings + hidden + rope) * _element_size(dtype)


def check_max_model_len(max_model_len: int | None, model: ModelConfig) -> None:
    if max_model_len and max_model_len > model.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's context of "
                         f"{model.max_position_embeddings} tokens")


def _fit_max_len(cfg: CacheSpec, blocks: int, block: int, max_len: int, where: str) -> int:
    capacity = blocks * block
    if capacity >= max_len:
        return max_len
    if cfg.max_model_len:
        raise ValueError(f"max_model_len {cfg.max_model_len} does not fit in the {where}: "
                         f"{blocks} blocks x {block} tokens = {capacity} tokens; lower "
                         "max_model_len or give the cache more memory")
    if capacity < 2:
        raise ValueError(f"the {where} holds only {capacity} tokens; give it more memory")
    return capacity                    # derived, so shrink it to what fits


def _default_budget(cfg: CacheSpec, device: torch.device, max_len: int) -> int:
    """max_num_batched_tokens where it is unset: small steps on the CPU; on CUDA 8192 tokens
    (16384 with offload, whose ring loads pay off over larger chunks), or the chunk the
    sparse prefill method asks for, up to max_len."""
    if device.type != "cuda":
        return 2048
    return max(16384 if cfg.offload else 8192, min(cfg.prefill_chunk_tokens, max_len))


def _device_blocks(cfg: CacheSpec, model: ModelConfig, dtype: torch.dtype, device: torch.device,
                   budget_tokens: int, block_bytes: int, memory: MemoryAvailable | None) -> int:
    if device.type == "cuda":
        available = _free_device_bytes(cfg, model, dtype, device, budget_tokens, memory)
    else:
        available = int(cfg.cpu_kv_cache_gib * _GiB)
    blocks = available // block_bytes
    if blocks < 1:
        raise ValueError(f"no memory left for the KV cache ({available / _MiB:.0f} MiB after weights "
                         "and activations); raise gpu_memory_utilization, lower "
                         "max_num_batched_tokens, or use offload=True")
    return int(blocks)


def _host_blocks(cfg: CacheSpec, max_len: int, block: int, block_bytes: int,
                 memory: MemoryAvailable | None) -> int:
    """`offload_host_gib`, else what max_num_seqs full sequences need, within half the host
    memory available; an explicit max_model_len gets one whole sequence even past that half,
    up to all but HOST_RESERVE of it (a million tokens of Qwen3-4B's fp8 KV: 72 GiB)."""
    if cfg.offload_host_gib is not None:
        return max(1, int(cfg.offload_host_gib * _GiB) // block_bytes)
    per_seq = -(-max_len // block)
    host = memory.host if memory is not None else _host_available_bytes()
    affordable = int(host * 0.5) // cfg.host_ranks // block_bytes
    if cfg.max_model_len:
        most = max(0, host - max(HOST_RESERVE, host // 8)) // cfg.host_ranks // block_bytes
        affordable = max(affordable, min(per_seq, most))
    return max(1, min(cfg.max_num_seqs * per_seq, affordable))


def _plan_offload(cfg: CacheSpec, model: ModelConfig, dtype: torch.dtype, device: torch.device,
                  budget: int, max_len: int, metadata_bytes: int, kv_dtype: torch.dtype,
                  memory: MemoryAvailable | None) -> OffloadPlan:
    block = cfg.block_size
    slots = cfg.offload_ring_slots
    layer_block_bytes = model.kv_bytes_per_token // model.num_layers * block * _element_size(kv_dtype)
    # Whole prefixes are packed dequantized, in the model's dtype.
    packed_block_bytes = layer_block_bytes * _element_size(dtype) // _element_size(kv_dtype)
    staging_blocks = -(-budget // block) + 1
    # A slot holds one full-length sequence's layer KV, or a batch of shorter ones: loads
    # stay large enough for PCIe efficiency while the ring stays a small share of memory.
    wanted = -(-max(max_len, min(cfg.max_num_seqs * max_len, _SLOT_TOKENS)) // block)
    if cfg.offload_slot_tokens:
        slot_blocks = -(-cfg.offload_slot_tokens // block)
    elif device.type == "cuda":
        fixed = (2 * staging_blocks + model.num_layers * (cfg.max_num_seqs + 1)) * layer_block_bytes \
            + metadata_bytes + cfg.device_reserve_bytes
        if cfg.whole_prefix:     # two max_model_len contexts packed, and one staged prefix piece
            fixed += 2 * -(-max_len // block) * packed_block_bytes \
                + CONTEXT_STAGE_BLOCKS * layer_block_bytes
        # A prefill step dequantizes a slot's context, or gathers a device layer's whole
        # context, one at a time; sized here as if both, so neither can squeeze the other.
        fixed += _device_layer_context(cfg, max_len, layer_block_bytes, packed_block_bytes)
        spare = _free_device_bytes(cfg, model, dtype, device, budget, memory) - fixed
        per_slot_block = slots * layer_block_bytes + packed_block_bytes
        slot_blocks = _whole_shape_steps(min(wanted, max(spare, 0) // per_slot_block), block)
    else:
        slot_blocks = min(wanted, _GiB // (slots * layer_block_bytes))
    if slot_blocks < 1:
        raise ValueError("no GPU memory left for the offload ring: one slot needs "
                         f"{layer_block_bytes / _MiB:.1f} MiB per block, and the sparse policy's "
                         f"device data takes {metadata_bytes / _MiB:.0f} MiB (Quest's dense layers "
                         "stay on the device, and with keys_on_device every other layer's keys) "
                         f"and its decode buffers {cfg.device_reserve_bytes / _MiB:.0f} "
                         f"MiB (Quest's reuse_pages) and scratch {cfg.decode_scratch_bytes / _MiB:.0f} "
                         "MiB (its selection's scores); lower max_num_batched_tokens, max_num_seqs, "
                         "offload_ring_slots, the host pool, the policy's dense layers or budget, or "
                         "raise gpu_memory_utilization")
    return OffloadPlan(slots, int(slot_blocks), staging_blocks)


def _whole_shape_steps(blocks: int, block: int) -> int:
    """A slot cut by the memory there is holds whole CUDNN_SHAPE_STEP runs of tokens where it
    can: a full slot's prefill part then keeps the shape cuDNN attention takes."""
    step = CUDNN_SHAPE_STEP // block if CUDNN_SHAPE_STEP % block == 0 else 1
    return blocks - blocks % step if blocks >= step else blocks


def _free_device_bytes(cfg: CacheSpec, model: ModelConfig, dtype: torch.dtype,
                       device: torch.device, budget_tokens: int,
                       memory: MemoryAvailable | None = None) -> int:
    free, total = ((memory.device_free, memory.device_total) if memory is not None
                   else torch.cuda.mem_get_info(device))
    reserve = (_activation_bytes(model, budget_tokens, cfg.max_num_seqs, dtype)
               + graph_sampling_bytes(cfg.graph_sampling_rows, model.vocab_size)
               + cfg.decode_scratch_bytes)
    return int(total * cfg.gpu_memory_utilization) - (total - free) - reserve


def _activation_bytes(model: ModelConfig, tokens: int, seqs: int, dtype: torch.dtype) -> int:
    """A generous bound on one step's transient memory: MLP, QKV, logits and graph pools."""
    mlp_tokens = min(tokens, 8192)                    # the decoder chunks longer MLPs
    width = 4 * model.hidden_size + (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    element = _element_size(dtype)
    logits = seqs * model.vocab_size * 4 * 4
    return (2 * tokens * width + 3 * mlp_tokens * model.intermediate_size) * element + logits + 512 * _MiB


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
