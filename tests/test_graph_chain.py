"""A chain of CUDA graphs with host parts between them (executor.graph_chain): what the
offloaded dense decode step replays, the copy engine loading each layer between graphs.
Needs a GPU; on the CPU the same programs run eagerly (tests/test_offload_graphs.py)."""

from __future__ import annotations

import pytest
import torch

from astream.executor.graph_chain import ChainCapture, ChainedStep, capturing_chain

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: counts captures, refuses a second end."""

    ended = 0

    def capture_begin(self, pool=None) -> None:
        self.capturing = True

    def capture_end(self) -> None:
        assert self.capturing, "capture_end without capture"
        self.capturing = False
        FakeGraph.ended += 1


def test_a_failing_host_part_ends_the_capture_once_and_its_error_comes_through(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    capture = ChainCapture(pool=None)
    capture.begin()

    def host_part():
        raise ValueError("the host part failed")

    with pytest.raises(ValueError, match="host part failed"):
        try:
            capture.cut(host_part)
        finally:
            capture.end()                # what capturing_chain's cleanup does
    assert FakeGraph.ended == 1 and not capture.open


@needs_gpu
def test_a_chain_runs_each_replays_host_copies_between_its_graphs():
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    sources = [torch.randn(4096, generator=gen).pin_memory() for _ in range(3)]
    x = torch.randn(4096, generator=gen).to(device)
    landing, out = torch.zeros(4096, device=device), torch.zeros(4096, device=device)
    copies, pick = torch.cuda.Stream(device), [0]
    host_parts = []

    def host_part() -> None:
        """A copy whose source the host picks per replay, which one graph would freeze."""
        copies.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(copies):
            landing.copy_(sources[pick[0]], non_blocking=True)
        torch.cuda.current_stream(device).wait_stream(copies)
        host_parts.append(pick[0])

    def program(capture) -> torch.Tensor:
        doubled = x * 2                       # lives across the cut, in the chain's pool
        capture.cut(host_part)
        tripled = landing * 3
        capture.cut(host_part)
        return doubled + tripled + landing

    with capturing_chain(torch.cuda.graph_pool_handle(), device) as capture:
        out.copy_(program(capture))
    assert len(capture.graphs) == 3
    finished = []
    step = ChainedStep(capture.graphs, None, between=lambda _: host_part(),
                       after=lambda: finished.append(True))
    for index in (2, 0, 1):
        pick[0] = index
        host_parts.clear()
        step.replay()
        torch.cuda.synchronize(device)
        want = x * 2 + sources[index].to(device) * 4
        torch.testing.assert_close(out, want)
        assert host_parts == [index, index]
    assert len(finished) == 3
