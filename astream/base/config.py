"""EngineConfig: every knob of the engine, validated with errors that say what to change."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16}
_FP8_KV = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_KV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, **_FP8_KV}
_KV_ALIASES = {"auto": "auto", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
               "fp8": "fp8_e4m3", **{name: name for name in _KV_DTYPES}}


def option(default: object, help: str, **metadata) -> Any:
    """A field with its help text: the command line shows it (cli.py reads metadata["help"])."""
    return field(default=default, metadata={"help": help, **metadata})


@dataclass(slots=True)
class EngineConfig:
    """Engine settings. `None` means "derive a sensible value" (see `resolve`)."""

    model: str | None = option(
        None, "HF folder, .gguf file or Hugging Face hub id; unset: the embedded SmolLM2-135M-Instruct")
    tokenizer: str | None = option(
        None, "a folder or .gguf file to take the tokenizer and chat template from; "
        "unset: the model's own")
    load_format: str = option(
        "auto", "auto: read the checkpoint's weights; dummy: random weights of the same shapes "
        "(for benchmarks)")
    device: str = option(
        "auto", "auto (the GPU when there is one, else the CPU), cpu, cuda or cuda:N")
    dtype: str = option(
        "auto", "weights and activations: auto (bfloat16 on CUDA, float32 on the CPU), "
        "bfloat16/bf16, float16/fp16/half or float32/fp32")
    max_model_len: int | None = option(
        None, "most tokens (prompt + output) one sequence may hold; unset: the model's context, "
        "capped by the KV memory there is")
    max_num_seqs: int = option(64, "most sequences running at once (continuous batching)")
    max_num_batched_tokens: int | None = option(
        None, "most tokens one step computes: the chunked-prefill budget; unset: 8192 on CUDA "
        "(16384 with offload, more where a sparse prefill policy asks for longer chunks), "
        "2048 on the CPU")
    kv_block_size: int | None = option(
        None, "tokens per KV block, a power of two; unset: 16, or 256 with offload")
    num_kv_blocks: int | None = option(
        None, "KV blocks on the device; unset: as many as the memory budget "
        "(gpu_memory_utilization or cpu_kv_cache_gib) allows")
    gpu_memory_utilization: float = option(
        0.85, "share of the GPU's free memory the engine may take, in [0.05, 0.99]")
    cpu_kv_cache_gib: float = option(1.0, "KV cache budget in GiB when the device is the CPU")
    enable_prefix_caching: bool = option(
        True, "reuse the KV of prompt prefixes already computed (shared system prompts, chat "
        "history)")
    enforce_eager: bool = option(False, "run every step eagerly: no CUDA graphs for decode")
    cuda_graph_max_batch: int = option(256, "largest decode batch captured in a CUDA graph")
    seed: int = option(0, "random seed for requests that bring none of their own")
    stream_buffer_tokens: int = option(
        1024, "tokens a request may have produced but its reader not yet taken before it "
        "pauses (backpressure; docs/ENGINE.md)")
    # KV offload: the cache lives in (pinned) host memory behind a small GPU ring.
    offload: bool = option(
        False, "keep the KV cache in pinned host memory behind a small GPU ring buffer, "
        "loaded layer by layer (long prompts on little GPU memory)")
    offload_host_gib: float | None = option(
        None, "host KV pool in GiB with offload, all tensor-parallel ranks together (each pins "
        "its share); unset: what max_num_seqs full sequences need")
    offload_ring_slots: int = option(
        3, "device buffers host KV loads into with offload; loads run this many layers ahead")
    offload_slot_tokens: int | None = option(
        None, "KV tokens one ring slot holds with offload; unset: sized from GPU memory")
    offload_prefetch_layers: int | None = option(
        None, "deprecated: use offload_ring_slots (= offload_prefetch_layers + 1)")
    sparse_policy: object = option(        # a policy name (policies/) or a SparsePolicy instance
        "full", "full, quest, window, xattention, minference, flexprefill, or a prefill+decode "
        "pair such as xattention+quest; parameters in parentheses, e.g. "
        "'xattention(threshold=0.95)'")
    sparse_budget: int | None = option(
        None, "KV tokens a sparse decode policy (quest, window) reads per step")
    kv_cache_dtype: str = option(          # how K/V are stored (docs/ENGINE.md, "FP8 KV cache")
        "auto", "auto (the model's dtype), bfloat16, float16, fp8_e4m3 or fp8_e5m2 "
        "(fp8 = fp8_e4m3): 8-bit floats halve the KV bytes")
    kv_cache_scale: float | None = option(  # fp8 only: one fixed scale; None: calibrated at start
        None, "fp8 KV only: store value / SCALE for every layer and head instead of scales "
        "calibrated when the engine starts")
    tensor_parallel_size: int = option(
        1, "processes (one GPU each, or CPU ranks over gloo) the model's heads, MLP and "
        "vocabulary are split across; the engine spawns the other ranks itself")
    nnodes: int = option(
        1, "hosts the tensor-parallel ranks span, tensor_parallel_size / nnodes on each; with "
        "more than one they meet through torch.distributed's env:// rendezvous at "
        "$MASTER_ADDR:$MASTER_PORT (node 0's address and a free port there)")
    node_rank: int = option(
        0, "this host's place among nnodes: node 0 runs the engine and its ranks; any other "
        "host runs only tensor-parallel ranks, started with `astream worker`")
    show_progress: bool | None = option(
        None, "show model loading on stderr (a bar, then the time it took); unset: when stderr "
        "is a terminal, unless $ASTREAM_SHOW_PROGRESS is 0")

    def __post_init__(self) -> None:
        if self.offload_prefetch_layers is not None:
            warnings.warn("offload_prefetch_layers is deprecated: it set offload_ring_slots to its "
                          "value + 1; pass offload_ring_slots instead", DeprecationWarning, stacklevel=4)
            _positive("offload_prefetch_layers", self.offload_prefetch_layers)
            self.offload_ring_slots = self.offload_prefetch_layers + 1
            self.offload_prefetch_layers = None
        self.validate()

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    def validate(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("offload_ring_slots", self.offload_ring_slots)
        _positive("cuda_graph_max_batch", self.cuda_graph_max_batch)
        _positive("stream_buffer_tokens", self.stream_buffer_tokens)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("nnodes", self.nnodes)
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes - 1 = {self.nnodes - 1}], "
                             f"got {self.node_rank}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} does not split over "
                             f"nnodes {self.nnodes}: every node runs the same number of ranks")
        for name in ("max_model_len", "max_num_batched_tokens", "num_kv_blocks", "kv_block_size",
                     "offload_slot_tokens", "sparse_budget"):
            value = getattr(self, name)
            if value is not None:
                _positive(name, value)
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.offload_host_gib is not None and self.offload_host_gib <= 0:
            raise ValueError(f"offload_host_gib must be > 0, got {self.offload_host_gib}")
        if self.kv_block_size and self.kv_block_size & (self.kv_block_size - 1):
            raise ValueError(f"kv_block_size must be a power of two, got {self.kv_block_size}")
        if not 0.05 <= self.gpu_memory_utilization <= 0.99:
            raise ValueError("gpu_memory_utilization must be in [0.05, 0.99], "
                             f"got {self.gpu_memory_utilization}")
        if self.cpu_kv_cache_gib <= 0:
            raise ValueError(f"cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")
        self.kv_cache_dtype = canonical_kv_dtype(self.kv_cache_dtype)
        if self.show_progress not in (None, True, False):
            raise ValueError(f"show_progress must be true, false or None, got {self.show_progress!r}")
        if self.kv_cache_scale is not None:
            if self.kv_cache_dtype not in _FP8_KV:
                raise ValueError("kv_cache_scale applies to an fp8 kv_cache_dtype only, got "
                                 f"kv_cache_dtype {self.kv_cache_dtype!r}")
            scale = self.kv_cache_scale
            if not isinstance(scale, (int, float)) or isinstance(scale, bool) \
                    or not 0 < scale < float("inf"):
                raise ValueError(f"kv_cache_scale must be a finite number > 0, got {self.kv_cache_scale!r}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; use one of {sorted(_DTYPES)} or 'auto'")
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"unknown device {self.device!r}; use 'auto', 'cpu', 'cuda' or 'cuda:N'")

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs) -> "EngineConfig":
        """Build from keyword arguments; an unknown keyword raises TypeError naming it."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known options: {sorted(known)}")
        return cls(model=model, **kwargs)

    @property
    def block_size(self) -> int:
        if self.kv_block_size is not None:
            return self.kv_block_size
        return 256 if self.offload else 16

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {self.device!r} was asked for but CUDA is not available; "
                               "use device='cpu'")
        return device

    def kv_storage_dtype(self) -> torch.dtype:
        """The KV cache's element type."""
        if self.kv_cache_dtype == "auto":
            return self.torch_dtype()
        return _KV_DTYPES[self.kv_cache_dtype]

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return _DTYPES[self.dtype]


def canonical_kv_dtype(name: object) -> str:
    """The canonical spelling of a kv_cache_dtype option; ValueError naming the choices."""
    canonical = _KV_ALIASES.get(name) if isinstance(name, str) else None
    if canonical is None:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; use one of "
                         f"{', '.join(['auto', *_KV_DTYPES])} (or fp8 for fp8_e4m3)")
    return canonical


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
