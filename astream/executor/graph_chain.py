"""A decode program captured as a chain of CUDA graphs, cut where the host must act.

One graph bakes every address in, so work whose addresses change from step to step
(the ring's copies out of the host pool) cannot live in it. A chain keeps the device
work in graphs and gives the host the moments between them: where the program needs the
host it calls `ChainCapture.cut(host_part)` (ends one graph, runs the host part outside
any capture, starts the next), and a replay runs graph 0, the host part of cut 0
(`between(0)`), graph 1, and so on. So a host part must be something the step can repeat
without the program: record an event, issue a copy, make the stream wait.

All graphs of every chain share one memory pool. Tensors that live across a cut keep
their addresses, since a chain's graphs replay in capture order with nothing between
them that allocates; chains of different batch sizes never run at the same time.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, TypeVar

import torch

from astream.executor.graph_sampling import (GraphSampler, capture_sampling, capture_tails, discard,
                                             sampling_modes, warm_up_sampling)

T = TypeVar("T")


@dataclass(slots=True)
class ChainCapture:
    """The graphs of a chain being captured, the last one still open."""

    pool: tuple
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    open: bool = False                   # the last graph is still capturing
    begun: list[torch.cuda.CUDAGraph] = field(default_factory=list)   # every graph begun, of every chain

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        self.begun.append(graph)
        graph.capture_begin(pool=self.pool)
        self.graphs.append(graph)
        self.open = True

    def end(self) -> None:
        if self.open:
            self.open = False
            self.graphs[-1].capture_end()

    def cut(self, host_part: Callable[[], T]) -> T:
        """Close the open graph, run `host_part` outside any capture, open the next graph;
        returns what the host part returns."""
        self.end()
        result = host_part()
        self.begin()
        return result


@contextlib.contextmanager
def capturing_chain(pool: tuple, device: torch.device,
                    begun: list | None = None) -> Iterator[ChainCapture]:
    """Capture on a side stream, as `torch.cuda.graph` does (the default stream cannot be
    captured); the host parts between the graphs run on that stream too. Each graph begun
    is also added to `begun`."""
    torch.cuda.synchronize(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    capture = ChainCapture(pool, begun=[] if begun is None else begun)
    try:
        with torch.cuda.stream(stream):
            capture.begin()
            try:
                yield capture
            finally:
                capture.end()        # a failed capture must leave capture mode, and say why
    finally:
        torch.cuda.current_stream(device).wait_stream(stream)


@dataclass(slots=True)
class ChainedStep:
    """One decode step: the chain (the host part `between(i)` after its graph i), then the
    sampling graph of one mode, if any, then the host's `after`."""

    graphs: list[torch.cuda.CUDAGraph]
    sampling: torch.cuda.CUDAGraph | None
    between: Callable[[int], object]
    after: Callable[[], object]

    def replay(self) -> None:
        last = len(self.graphs) - 1
        for index, graph in enumerate(self.graphs):
            graph.replay()
            if index < last:
                self.between(index)
        if self.sampling is not None:
            self.sampling.replay()
        self.after()


ChainRun = Callable[[int, "ChainCapture | None"], torch.Tensor]   # (size, capture) -> hidden


def capture_chained_steps(sizes: list[int], run: ChainRun, sampler: GraphSampler, out: torch.Tensor,
                          device: torch.device, between: Callable[[int], object],
                          after: Callable[[], object]) -> dict[tuple, ChainedStep | torch.cuda.CUDAGraph]:
    """Per size, largest first: `run(size, capture)` captured as one chain (its hidden states
    into out[:size]), one sampling graph per mode after it, and the sampling tails that
    follow the greedy step, as `graph_sampling.capture_sampling_graphs` captures a whole step,
    and like it destroying every graph begun where a capture fails."""
    steps, pool, begun = {}, torch.cuda.graph_pool_handle(), []
    modes = sampling_modes()
    try:
        for size in sorted(sizes, reverse=True):
            warm_up_sampling(sampler, run(size, None))   # warm-up (Triton compiles, cuBLAS plans)
            with capturing_chain(pool, device, begun) as capture:
                out[:size] = run(size, capture)
            for mode in modes:
                sampling = capture_sampling(sampler, out[:size], mode, pool, begun)
                steps[mode, size] = ChainedStep(capture.graphs, sampling, between, after)
            steps.update(capture_tails(sampler, size, pool, begun))
        torch.cuda.synchronize(device)
    except BaseException:
        discard(begun)
        raise
    return steps
