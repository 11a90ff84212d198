"""The end of a decode step inside its CUDA graph: logits and sampling, into static buffers.

Each captured batch size has one whole-step graph per plain sampling mode:
- "greedy": every row takes its argmax; it also leaves the float32 logits in a static table;
- "temperature": rows sample at their temperature (greedy rows, temperature 0, take the
  argmax), drawing from the engine's generator, which each graph registers so a replay
  advances it as an eager step would.
A step whose rows need top-k, top-p, penalties, min_tokens or logprobs replays the greedy
graph and then the tail graph of its `Tail` (executor.sampling_tail), which samples from
that logits table. Only a step with a request seed (a generator per row, chosen on the
host) replays the greedy graph for its hidden states and samples eagerly from them.

Under tensor parallelism only rank 0's graphs have the tails and their tables: the other
ranks replay the whole-step graphs alone (they hold the logits' gather, which every rank
must join) and drop what those sample for rank 0's ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from astream.executor.logprobs import StepLogprobs
from astream.executor.sampler import SamplingBatch, sample
from astream.executor.sampling_tail import SamplingTables, Tail, tail_mode, tail_modes
from astream.models.decoder import Decoder

GRAPH_MODES = ("greedy", "temperature")
RunFn = Callable[[int], torch.Tensor]            # static program of `size` rows -> hidden
Mode = str | Tail                                # a whole-step graph's, or a tail's after "greedy"


def graph_mode(batch: SamplingBatch) -> Mode | None:
    """The captured mode that samples this batch as `sample` would, or None (the host does)."""
    if batch.plain and batch.all_greedy:
        return "greedy"
    if batch.plain and batch.top_k is None and batch.top_p is None and not batch.seeded_rows:
        return "temperature"
    return tail_mode(batch)


@dataclass(slots=True)
class GraphSampler:
    decoder: Decoder
    generator: torch.Generator
    temperatures: torch.Tensor           # [B] float32, filled before each replay
    token_ids: torch.Tensor              # [B] int64, written by the graph
    tables: SamplingTables | None        # what the tails read, and their logprobs; None: no tails
    sampled_inside: int = 0              # steps whose ids came from the static program

    @classmethod
    def allocate(cls, decoder: Decoder, generator: torch.Generator, max_batch: int,
                 tails: bool = True) -> "GraphSampler":
        """`tails` False: a sampler without the tails' tables, whose graphs capture no tail."""
        device = decoder.device
        tables = SamplingTables.allocate(max_batch, decoder.config.vocab_size, device) if tails else None
        return cls(decoder, generator, torch.ones(max_batch, dtype=torch.float32, device=device),
                   torch.zeros(max_batch, dtype=torch.int64, device=device), tables)

    def program(self, hidden: torch.Tensor, mode: str) -> None:
        """Sample every row of hidden [size, H] into token_ids[:size] (what a graph captures)."""
        size = hidden.shape[0]
        # The greedy graph's logits stay in the table a tail reads: written there by the
        # conversion to float32 every step makes anyway.
        keep = mode == "greedy" and self.tables is not None
        logits = self.decoder.logits(hidden, self.tables.logits[:size] if keep else None)
        batch = SamplingBatch(temperatures=self.temperatures[:size], top_k=None, top_p=None,
                              all_greedy=mode == "greedy", seeded_rows=[])
        self.token_ids[:size] = sample(logits, batch, self.generator)

    def tail(self, size: int, tail: Tail) -> None:
        """Sample rows :size from the greedy program's logits as `tail` says (a tail graph)."""
        self.token_ids[:size] = self.tables.program(size, tail, self.temperatures, self.generator)

    def fill(self, batch: SamplingBatch, n: int, size: int, mode: Mode,
             previous_ids: torch.Tensor | None) -> None:
        """What `mode` reads of this step's rows :n; padding rows sample at temperature 1."""
        tail = mode if isinstance(mode, Tail) else None
        if mode == "temperature" or (tail is not None and tail.draw):
            self.temperatures[:n].copy_(batch.temperatures)
            self.temperatures[n:size].fill_(1.0)
        if tail is not None:
            self.tables.fill(batch, n, size, tail, previous_ids)

    def logprobs(self, n: int) -> StepLogprobs:
        """Rows :n of the logprobs of the last step sampled by a tail that computes them."""
        return self.tables.logprobs(n)


def sampling_modes() -> tuple[str, ...]:
    """The modes a whole-step graph can sample in: a torch without graph-safe custom
    generators captures greedy only, and the host samples the rest."""
    return GRAPH_MODES if _draws() else ("greedy",)


def _draws() -> bool:
    return hasattr(torch.cuda.CUDAGraph, "register_generator_state")


def _tails(sampler: GraphSampler) -> list[Tail]:
    """The tails `sampler`'s graphs capture: none where it has no tables."""
    return tail_modes(_draws()) if sampler.tables is not None else []


def captured_mode(graphs: dict, size: int, mode: Mode | None) -> Mode | None:
    """The mode a step padded to `size` samples in: `mode` where its graph was captured, or
    where none was (the static programs run eagerly: CPU, tests); None where the host samples."""
    return mode if not graphs or (mode, size) in graphs else None


def step_keys(graphs: dict) -> list:
    """The (mode, size) keys of the whole-step graphs, in a fixed order: what every
    tensor-parallel rank captures alike (they hold the step's collectives), the tails left
    out (rank 0's alone)."""
    return sorted((key for key in graphs if not isinstance(key[0], Tail)), key=repr)


def warm_up_sampling(sampler: GraphSampler, hidden: torch.Tensor) -> None:
    """Run every sampling program of `hidden`'s size once before capture (the greedy one
    first: the tails read its logits)."""
    size = hidden.shape[0]
    for mode in sampling_modes():
        sampler.program(hidden, mode)
    for tail in _tails(sampler):
        sampler.tail(size, tail)


def capture_sampling(sampler: GraphSampler, hidden: torch.Tensor, mode: str, pool: tuple,
                     begun: list | None = None) -> torch.cuda.CUDAGraph:
    """A graph of `sampler.program(hidden, mode)` alone (added to `begun` before its capture)."""
    graph = _new_graph(sampler, mode != "greedy")
    if begun is not None:
        begun.append(graph)
    with torch.cuda.graph(graph, pool=pool):
        sampler.program(hidden, mode)
    return graph


def capture_tails(sampler: GraphSampler, size: int, pool: tuple,
                  begun: list | None = None) -> dict[tuple[Tail, int], torch.cuda.CUDAGraph]:
    """One graph of `sampler.tail(size, tail)` per tail, after the greedy graph of `size`
    (each added to `begun` before its capture); none for a sampler without tables."""
    graphs = {}
    for tail in _tails(sampler):
        graph = _new_graph(sampler, tail.draw)
        if begun is not None:
            begun.append(graph)
        with torch.cuda.graph(graph, pool=pool):
            sampler.tail(size, tail)
        graphs[tail, size] = graph
    return graphs


def _new_graph(sampler: GraphSampler, draws: bool) -> torch.cuda.CUDAGraph:
    """A graph whose replays advance the sampler's generator where it draws from it."""
    graph = torch.cuda.CUDAGraph()
    if draws:
        graph.register_generator_state(sampler.generator)
    return graph


def capture_sampling_graphs(sizes: list[int], run: RunFn, sampler: GraphSampler, out: torch.Tensor,
                            device: torch.device) -> dict[tuple[Mode, int], torch.cuda.CUDAGraph]:
    """One whole-step graph per (mode, size), largest first, and the tails of each size (where
    the sampler has tables), sharing one memory pool: a whole-step replay runs `run(size)`
    over the static buffers, leaves its hidden states in out[:size] and its sampled ids in
    sampler.token_ids[:size]; a tail's, its ids there from the greedy replay's logits. Where
    a capture fails, every graph begun is destroyed (`discard`) before the error goes on."""
    modes = sampling_modes()
    graphs, pool, begun = {}, torch.cuda.graph_pool_handle(), []
    try:
        for size in sorted(sizes, reverse=True):
            warm_up_sampling(sampler, run(size))         # warm-up (Triton compiles, cuBLAS plans)
            torch.cuda.synchronize(device)
            for mode in modes:
                graph = _new_graph(sampler, mode != "greedy")
                begun.append(graph)
                with torch.cuda.graph(graph, pool=pool):
                    out[:size] = run(size)
                    sampler.program(out[:size], mode)
                graphs[mode, size] = graph
            graphs.update(capture_tails(sampler, size, pool, begun))
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


def replay(graphs: dict, size: int, n: int, mode: Mode | None, batch: SamplingBatch | None,
           sampler: GraphSampler, run: RunFn, out: torch.Tensor,
           previous_ids: torch.Tensor | None = None) -> torch.Tensor | None:
    """Replay the step padded to `size` rows (where nothing was captured, run its program
    eagerly: CPU, tests), sampling in `mode` (`graph_mode` of the step's batch): a tail mode
    replays the greedy graph, then the tail's. Returns the n rows' sampled ids, or None where
    the host samples from out[:n]. `previous_ids`: the previous step's ids, for penalized
    rows' newest tokens. `batch` None: a tensor-parallel follower, in the mode rank 0's
    graphs sample this step in (`captured_mode`, sent with the step), whose ids rank 0's
    replace: it runs no tail and has none (the greedy graph holds the logits' gather, which
    every rank must join; a tail holds no collective), so a tail mode replays its greedy graph."""
    if batch is not None:
        mode = captured_mode(graphs, size, mode)        # not captured: the host samples
    tail = mode if isinstance(mode, Tail) else None
    base = "greedy" if mode is None or tail is not None else mode
    if mode is not None and batch is not None:
        sampler.fill(batch, n, size, mode, previous_ids)
    graph = graphs.get((base, size))
    if graph is not None:
        graph.replay()
    else:
        out[:size] = run(size)
        if mode is not None:
            sampler.program(out[:size], base)
    if tail is not None and batch is not None:
        tail_graph = graphs.get((tail, size))
        if tail_graph is not None:
            tail_graph.replay()
        else:
            sampler.tail(size, tail)
    if mode is None:
        return None
    sampler.sampled_inside += 1
    # A copy, not a view of the buffer the next step writes: on the CPU the host copy of
    # these ids is the tensor itself.
    return sampler.token_ids[:n].clone()
