"""Assemble a ModelRunner with its KV backend: the device paged cache (and CUDA graphs),
or the host pool behind the OffloadEngine. Attention kernels are chosen and the sparse
policy is bound to the cache here, once."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from astream.base.config import EngineConfig
from astream.executor.cuda_graphs import DecodeGraphs
from astream.executor.graph_chain import ChainedStep
from astream.executor.graph_sampling import discard
from astream.executor.offload_graphs import OffloadDecodeGraphs, decodes_densely, selects_everywhere
from astream.executor.runner import ModelRunner
from astream.kvcache.calibration import calibrate_format, calibration_ids, scaled_format
from astream.kvcache.kv_format import KVFormat, is_fp8
from astream.kvcache.offload_engine import OffloadEngine
from astream.kvcache.paged_cache import PagedKVCache
from astream.kvcache.sizing import CachePlan
from astream.models.decoder import Decoder
from astream.ops import cudnn_attention
from astream.ops.backends import AttentionBackends
from astream.policies import KVLayout, SparsePolicy
from astream.runtime.device import DeviceRuntime

log = logging.getLogger("astream")
# Releasing graphs waits at most this long for the device to go idle.
RELEASE_DRAIN_S = 30.0


def kv_format(config: EngineConfig, decoder: Decoder, tokenizer) -> KVFormat:
    """How the engine stores K/V: `kv_cache_dtype`, and for fp8 the scales, fixed now (a
    forward pass over astream.kvcache.calibration's text, or `kv_cache_scale`)."""
    dtype = config.kv_storage_dtype()
    if not is_fp8(dtype):
        return KVFormat(dtype, decoder.dtype)
    cfg = decoder.config
    if config.kv_cache_scale is not None:
        return scaled_format(dtype, decoder.dtype, cfg.num_layers, cfg.num_kv_heads,
                             decoder.device, config.kv_cache_scale)
    return calibrate_format(decoder, calibration_ids(tokenizer, cfg.vocab_size), dtype)


def build_runner(config: EngineConfig, plan: CachePlan, decoder: Decoder, runtime: DeviceRuntime,
                 policy: SparsePolicy, fmt: KVFormat | None = None,
                 eos_ids: frozenset[int] = frozenset()) -> ModelRunner:
    """`fmt`: the KV format (`kv_format`); None stores KV in the model's dtype. `eos_ids`:
    what min_tokens holds back besides a request's stop_token_ids."""
    dtype, device, model = decoder.dtype, runtime.device, decoder.config
    fmt = fmt or KVFormat.plain(dtype)
    backends = AttentionBackends.select(device, dtype, model.head_dim)
    # One scratch block past the last: padded rows of a CUDA-graph batch write there.
    layout = KVLayout(model.num_layers, model.num_heads, model.num_kv_heads, model.head_dim,
                      plan.num_blocks + 1, plan.block_size, dtype, device, config.offload,
                      key_dtype=fmt.dtype, max_num_seqs=config.max_num_seqs)
    generator = torch.Generator(device=device)
    generator.manual_seed(config.seed)
    bound = policy.bind(layout)
    planned = frozenset(policy.offload_device_layers(model.num_layers) if config.offload else ())
    if bound.traits.device_layers != planned:
        raise ValueError(f"sparse policy {policy.name}: its runtime keeps layers "
                         f"{sorted(bound.traits.device_layers)} on the device, but the memory plan "
                         f"counted {sorted(planned)} (offload_device_layers)")
    parts = dict(decoder=decoder, runtime=runtime, backends=backends, policy=bound,
                 generator=generator, block_size=plan.block_size, eos_ids=eos_ids)
    if config.offload:
        sizes = plan.offload
        offload = OffloadEngine.allocate(
            model, plan.num_blocks, plan.block_size, sizes.num_slots, sizes.slot_blocks,
            sizes.staging_blocks, config.max_num_seqs, fmt, runtime,
            device_layers=tuple(sorted(bound.traits.device_layers)),
            key_layers=policy.offload_key_layers(model.num_layers))
        runner = ModelRunner(**parts, offload=offload)
    else:
        cache = PagedKVCache.allocate(model, plan.num_blocks, plan.block_size, fmt, device)
        runner = ModelRunner(**parts, cache=cache)
    runner.graphs = build_graphs(config, plan, runner)
    warm_up_prefill_plans(plan, runner)
    return runner


def warm_up_prefill_plans(plan: CachePlan, runner: ModelRunner) -> None:
    """Build cuDNN's plans for every prefill shape the engine can meet, before the first
    request: built later, each would stall the step that first meets it (ops.cudnn_attention).
    Where cuDNN fails here (a library mismatch, no memory for the largest shape), prefill
    keeps FlashAttention-2 and the engine starts all the same."""
    if not runner.backends.cudnn_prefill:
        return
    model, started = runner.decoder.config, time.perf_counter()
    try:
        with torch.inference_mode():
            count = cudnn_attention.warm_up(
                cudnn_attention.cudnn_dense, runner.backends.merge_into_rows,
                plan.max_num_batched_tokens, plan.max_model_len, model.num_heads,
                model.num_kv_heads, model.head_dim, runner.decoder.dtype, runner.runtime.device,
                runner.scale)
    except RuntimeError as exc:              # torch.OutOfMemoryError is one too
        runner.backends = replace(runner.backends, cudnn_prefill=False)
        log.warning("astream: cuDNN prefill attention is off (%s: %s); prefill uses %s",
                    type(exc).__name__, str(exc)[:200], runner.backends.varlen_name)
        return
    log.info("astream: cuDNN prefill attention ready, %d shapes planned in %.1f s", count,
             time.perf_counter() - started)


@dataclass(slots=True, frozen=True)
class GraphSpec:
    """Which decode graphs a runner captures: "resident" (executor.cuda_graphs), "offload"
    (one graph a step: the policy selects on every offloaded layer) or "dense" (a chain of
    graphs a step: it never selects; executor.offload_graphs), for these shapes."""

    kind: str
    max_batch: int
    max_blocks_per_seq: int
    max_context: int


def graph_spec(config: EngineConfig, plan: CachePlan, runner: ModelRunner) -> GraphSpec | None:
    """The decode graphs that fit the runner's KV backend and policy, on any device; None
    where decode steps cannot be static: with offload under a policy whose plan at the
    longest context selects decode pages on some offloaded layers only (those steps read
    through the ring)."""
    shape = dict(max_batch=max_graph_batch(config),
                 max_blocks_per_seq=-(-plan.max_model_len // plan.block_size),
                 max_context=plan.max_model_len)
    layers = runner.decoder.config.num_layers
    if runner.offload is None:
        return GraphSpec("resident", **shape)
    if selects_everywhere(runner.policy, runner.offload, layers, plan.max_model_len):
        return GraphSpec("offload", **shape)
    if decodes_densely(runner.policy, layers, plan.max_model_len):
        return GraphSpec("dense", **shape)
    return None


def make_graphs(spec: GraphSpec, runner: ModelRunner) -> DecodeGraphs | OffloadDecodeGraphs:
    """The decode graphs of `spec` with their static buffers, not captured yet: until then
    they run their program eagerly. The sampling tails and their tables only where the
    runner's rank samples (`captures_tails`)."""
    shape = dict(max_batch=spec.max_batch, max_blocks_per_seq=spec.max_blocks_per_seq,
                 max_context=spec.max_context, tails=captures_tails(runner.decoder.rank))
    if spec.kind == "resident":
        return DecodeGraphs(runner.decoder, runner.cache, runner.backends, runner.policy,
                            runner.generator, **shape)
    return OffloadDecodeGraphs(runner.decoder, runner.offload, runner.backends, runner.policy,
                               runner.generator, **shape, dense=spec.kind == "dense")


def capture_graphs(spec: GraphSpec, runner: ModelRunner) -> DecodeGraphs | OffloadDecodeGraphs:
    """`make_graphs`, captured on CUDA (on the CPU their program keeps running eagerly). A
    capture that fails destroys the graphs it had captured, their memory pool with them,
    and raises. Under tensor parallelism every rank calls this at once with the same spec
    (parallel.WorkerGroup.install_graphs): the warm-up runs and the captures hold the
    ranks' collectives, which must meet in the same order on every rank."""
    graphs = make_graphs(spec, runner)
    if runner.runtime.is_cuda:
        with torch.inference_mode():
            graphs.capture()
    return graphs


def release_graphs(graphs: DecodeGraphs | OffloadDecodeGraphs | None, runtime: DeviceRuntime) -> None:
    """Destroy every CUDA graph of `graphs` (a runner's decode graphs; None: none), once the
    device is idle (waiting at most RELEASE_DRAIN_S); they cannot be replayed after. NCCL
    frees a communicator only once every graph that captured one of its collectives is gone,
    so under tensor parallelism each rank releases its graphs as it leaves the process group
    (parallel.group.leave_group), whoever still holds them."""
    if graphs is None or not runtime.is_cuda:
        return
    if not runtime.drain(RELEASE_DRAIN_S):
        log.warning("astream: the device did not go idle within %.0f s (a collective waiting "
                    "on a rank that is gone?); destroying the CUDA graphs without waiting "
                    "(CUDA frees one still running once it ends)", RELEASE_DRAIN_S)
    discard(captured(graphs))


def captured(graphs: DecodeGraphs | OffloadDecodeGraphs) -> list:
    """The CUDA graphs a runner's decode graphs hold, each once: one per (mode, size), a
    whole step's or a sampling tail's, or a chained step's chain (shared by its modes) and
    its sampling graph."""
    found: dict[int, object] = {}
    for entry in graphs.graphs.values():
        parts = [*entry.graphs, entry.sampling] if isinstance(entry, ChainedStep) else [entry]
        found.update((id(graph), graph) for graph in parts if graph is not None)
    return list(found.values())


def captures_graphs(config: EngineConfig, device: torch.device) -> bool:
    """Whether decode steps on `device` may run from CUDA graphs: on CUDA, unless
    enforce_eager (and then only where the KV backend and policy allow them: `graph_spec`)."""
    return device.type == "cuda" and not config.enforce_eager


def captures_tails(rank: int) -> bool:
    """Whether a rank's decode graphs have the sampling tails and their tables
    (executor.sampling_tail): one rank's, or rank 0's under tensor parallelism. Rank 0
    samples every step and broadcasts the ids; the other ranks replay only the whole-step
    graphs, which hold the logits' gather every rank must join, and drop what they sample."""
    return rank == 0


def max_graph_batch(config: EngineConfig) -> int:
    """The largest decode batch the graphs capture."""
    return min(config.cuda_graph_max_batch, config.max_num_seqs)


def graph_sampling_rows(config: EngineConfig, device: torch.device, rank: int = 0) -> int:
    """The rows of the sampling tables that the decode graphs of rank `rank` on `device` keep,
    and the memory plan reserves (kvcache.sizing.graph_sampling_bytes): the largest captured
    batch where decode steps are captured and the rank captures tails; 0 on the CPU, under
    enforce_eager and on a tensor-parallel rank other than 0. The policy is bound only after
    the plan, so rows are kept for the graphs `graph_spec` may still rule out (with offload,
    a policy that selects decode pages on some offloaded layers only; no built-in one does)."""
    if not (captures_graphs(config, device) and captures_tails(rank)):
        return 0
    return max_graph_batch(config)


def build_graphs(config: EngineConfig, plan: CachePlan,
                 runner: ModelRunner) -> DecodeGraphs | OffloadDecodeGraphs | None:
    """Decode steps captured in CUDA graphs for the runner's KV backend (`graph_spec`), or
    None where steps run eagerly: on the CPU, under enforce_eager, and with offload under a
    policy that selects decode pages on some offloaded layers only. With offload, a policy
    that selects on every offloaded layer gathers its pages in the graph, and one that never
    selects loads whole contexts between a chain of graphs (executor.offload_graphs).

    None too for a tensor-parallel rank: its graphs are captured later, by every rank at
    once (`capture_graphs`), once all of them have built their runners."""
    if not captures_graphs(config, runner.runtime.device) or runner.decoder.tp is not None:
        return None
    spec = graph_spec(config, plan, runner)
    return None if spec is None else capture_graphs(spec, runner)
