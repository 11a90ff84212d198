"""The end of a decode step inside its CUDA graph: logits and sampling, into static buffers.

Each captured batch size has one graph per sampling mode:
- "greedy": every row takes its argmax;
- "temperature": rows sample at their temperature (greedy rows, temperature 0, take the
  argmax), drawing from the engine's generator, which each graph registers so a replay
  advances it as an eager step would.
A step whose rows need top-k, top-p, a request seed (a generator per row, chosen on the
host), penalties, min_tokens or logprobs replays the greedy graph for its hidden states
and samples eagerly from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from astream.executor.sampler import SamplingBatch, sample
from astream.models.decoder import Decoder

GRAPH_MODES = ("greedy", "temperature")
RunFn = Callable[[int], torch.Tensor]            # static program of `size` rows -> hidden


def graph_mode(batch: SamplingBatch) -> str | None:
    """The captured mode that samples this batch exactly as `sample` would, or None."""
    if not batch.plain:
        return None
    if batch.all_greedy:
        return "greedy"
    if batch.top_k is None and batch.top_p is None and not batch.seeded_rows:
        return "temperature"
    return None


@dataclass(slots=True)
class GraphSampler:
    decoder: Decoder
    generator: torch.Generator
    temperatures: torch.Tensor           # [B] float32, filled before each replay
    token_ids: torch.Tensor              # [B] int64, written by the graph
    sampled_inside: int = 0              # steps whose ids came from the static program

    @classmethod
    def allocate(cls, decoder: Decoder, generator: torch.Generator, max_batch: int) -> "GraphSampler":
        device = decoder.device
        return cls(decoder, generator, torch.ones(max_batch, dtype=torch.float32, device=device),
                   torch.zeros(max_batch, dtype=torch.int64, device=device))

    def program(self, hidden: torch.Tensor, mode: str) -> None:
        """Sample every row of hidden [size, H] into token_ids[:size] (what a graph captures)."""
        size = hidden.shape[0]
        logits = self.decoder.logits(hidden)
        batch = SamplingBatch(temperatures=self.temperatures[:size], top_k=None, top_p=None,
                              all_greedy=mode == "greedy", seeded_rows=[])
        self.token_ids[:size] = sample(logits, batch, self.generator)

    def fill(self, batch: SamplingBatch, n: int, size: int) -> None:
        """This step's temperatures into rows :n; padding rows sample at temperature 1."""
        self.temperatures[:n].copy_(batch.temperatures)
        self.temperatures[n:size].fill_(1.0)


def sampling_modes() -> tuple[str, ...]:
    """The modes a graph can sample in: a torch without graph-safe custom generators
    captures greedy only, and the host samples the rest."""
    return GRAPH_MODES if hasattr(torch.cuda.CUDAGraph, "register_generator_state") else ("greedy",)


def capture_sampling(sampler: GraphSampler, hidden: torch.Tensor, mode: str, pool: tuple,
                     begun: list | None = None) -> torch.cuda.CUDAGraph:
    """A graph of `sampler.program(hidden, mode)` alone (added to `begun` before its capture)."""
    graph = _new_graph(sampler, mode)
    if begun is not None:
        begun.append(graph)
    with torch.cuda.graph(graph, pool=pool):
        sampler.program(hidden, mode)
    return graph


def _new_graph(sampler: GraphSampler, mode: str) -> torch.cuda.CUDAGraph:
    """A graph whose replays advance the sampler's generator where the mode draws from it."""
    graph = torch.cuda.CUDAGraph()
    if mode != "greedy":
        graph.register_generator_state(sampler.generator)
    return graph


def capture_sampling_graphs(sizes: list[int], run: RunFn, sampler: GraphSampler, out: torch.Tensor,
                            device: torch.device) -> dict[tuple[str, int], torch.cuda.CUDAGraph]:
    """One graph per (mode, size), largest first, sharing one memory pool: each replay runs
    `run(size)` over the static buffers, leaves its hidden states in out[:size] and its
    sampled ids in sampler.token_ids[:size]. Where a capture fails, every graph begun is
    destroyed (`discard`) before the error goes on."""
    modes = sampling_modes()
    graphs, pool, begun = {}, torch.cuda.graph_pool_handle(), []
    try:
        for size in sorted(sizes, reverse=True):
            hidden = run(size)                           # warm-up (Triton compiles, cuBLAS plans)
            for mode in modes:
                sampler.program(hidden, mode)
            torch.cuda.synchronize(device)
            for mode in modes:
                graph = _new_graph(sampler, mode)
                begun.append(graph)
                with torch.cuda.graph(graph, pool=pool):
                    out[:size] = run(size)
                    sampler.program(out[:size], mode)
                graphs[mode, size] = graph
        torch.cuda.synchronize(device)
    except BaseException:
        discard(begun)
        raise
    return graphs


def discard(graphs) -> None:
    """Destroy each CUDA graph of `graphs` now, with its share of the memory pool: the error
    of a failed capture holds them (its traceback, their frames) for as long as it lives,
    and under tensor parallelism NCCL frees a communicator only once every graph holding its
    collectives is gone. A graph whose capture broke off is destroyed as far as it got."""
    for graph in graphs:
        try:
            graph.reset()
        except RuntimeError:
            pass


def replay(graphs: dict, size: int, n: int, mode: str | None, batch: SamplingBatch | None,
           sampler: GraphSampler, run: RunFn, out: torch.Tensor) -> torch.Tensor | None:
    """Replay the step padded to `size` rows (where nothing was captured, run its program
    eagerly: CPU, tests), sampling in `mode` (`graph_mode` of the step's batch). Returns the
    n rows' sampled ids, or None where the host samples from out[:n]. `batch` None: a
    tensor-parallel follower, whose ids rank 0's replace, so its temperatures stay as they are."""
    if graphs and (mode, size) not in graphs:
        mode = None                                      # not captured: the host samples
    if mode == "temperature" and batch is not None:      # the only program that reads them
        sampler.fill(batch, n, size)
    graph = graphs.get((mode or "greedy", size))
    if graph is not None:
        graph.replay()
    else:
        out[:size] = run(size)
        if mode is not None:
            sampler.program(out[:size], mode)
    if mode is None:
        return None
    sampler.sampled_inside += 1
    # A copy, not a view of the buffer the next step writes: on the CPU the host copy of
    # these ids is the tensor itself.
    return sampler.token_ids[:n].clone()
