"""EngineConfig: every knob of the engine, validated with errors that say what to change."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

import torch

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16}
_FP8_KV = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_KV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, **_FP8_KV}
_KV_ALIASES = {"auto": "auto", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
               "fp8": "fp8_e4m3", **{name: name for name in _KV_DTYPES}}


@dataclass(slots=True)
class EngineConfig:
    """Engine settings. `None` means "derive a sensible value" (see `resolve`)."""

    model: str | None = None               # HF folder or .gguf file; None: embedded SmolLM2
    tokenizer: str | None = None           # defaults to the model's own
    load_format: str = "auto"              # "auto", or "dummy": random weights (benchmarks)
    device: str = "auto"                   # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"                    # "auto": bfloat16 on CUDA, float32 on CPU
    max_model_len: int | None = None       # prompt + output tokens of one sequence
    max_num_seqs: int = 64                 # sequences running at once
    max_num_batched_tokens: int | None = None  # tokens one step may compute (chunked prefill budget)
    kv_block_size: int | None = None       # tokens per KV block; None: 16, or 256 with offload
    num_kv_blocks: int | None = None       # KV blocks on the device
    gpu_memory_utilization: float = 0.85   # share of free GPU memory the engine may take
    cpu_kv_cache_gib: float = 1.0          # KV budget when the "device" is the CPU
    enable_prefix_caching: bool = True
    enforce_eager: bool = False            # no CUDA graphs
    cuda_graph_max_batch: int = 256        # largest decode batch captured in a graph
    seed: int = 0                          # for requests without their own seed
    stream_buffer_tokens: int = 1024       # unread tokens before a request pauses (docs/ENGINE.md)
    # KV offload: the cache lives in (pinned) host memory behind a small GPU ring.
    offload: bool = False
    offload_host_gib: float | None = None  # host KV pool; None: what max_num_seqs full sequences need
    offload_ring_slots: int = 3            # device buffers host KV loads into; loads run this many ahead
    offload_slot_tokens: int | None = None # KV tokens one ring slot holds; None: sized from GPU memory
    offload_prefetch_layers: int | None = None   # deprecated: offload_ring_slots - 1
    sparse_policy: object = field(         # a policy name (policies/) or a SparsePolicy instance
        default="full", metadata={"help": "full, quest, xattention, minference, or a prefill+decode "
                                  "pair such as xattention+quest; parameters in parentheses, e.g. "
                                  "'xattention(threshold=0.95)'"})
    sparse_budget: int | None = None       # KV tokens a sparse decode reads (a policy given by name)
    kv_cache_dtype: str = field(           # how K/V are stored (docs/ENGINE.md, "FP8 KV cache")
        default="auto", metadata={"help": "auto (the model's dtype), bfloat16, float16, fp8_e4m3 "
                                  "or fp8_e5m2 (fp8 = fp8_e4m3): 8-bit floats halve the KV bytes"})
    kv_cache_scale: float | None = field(  # fp8 only: one fixed scale; None: calibrated at start
        default=None, metadata={"help": "fp8 KV only: store value / SCALE for every layer and "
                                "head instead of scales calibrated when the engine starts"})

    def __post_init__(self) -> None:
        if self.offload_prefetch_layers is not None:
            warnings.warn("offload_prefetch_layers is deprecated: it set offload_ring_slots to its "
                          "value + 1; pass offload_ring_slots instead", DeprecationWarning, stacklevel=4)
            _positive("offload_prefetch_layers", self.offload_prefetch_layers)
            self.offload_ring_slots = self.offload_prefetch_layers + 1
            self.offload_prefetch_layers = None
        self.validate()

    def validate(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("offload_ring_slots", self.offload_ring_slots)
        _positive("cuda_graph_max_batch", self.cuda_graph_max_batch)
        _positive("stream_buffer_tokens", self.stream_buffer_tokens)
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
