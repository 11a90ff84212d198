"""What an engine counts as requests finish and steps complete: outcomes, tokens, and
latency histograms.

Plain data, updated by each request's output channel on the thread that drives the core
and read when something asks (the server's /metrics renders it for Prometheus, together
with the gauges of `Engine.stats()`).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
STEP_BUCKETS_S = (0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
STEP_KINDS = ("prefill", "decode")      # a step with a prompt chunk of more than one token, or not


@dataclass(slots=True)
class Histogram:
    """Observations counted per bucket (`bounds`: upper bounds, +Inf implied) and summed."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)     # one per bound, then +Inf
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= it) per bucket, +Inf last."""
        out, running = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts):
            running += count
            out.append((bound, running))
        return out


@dataclass(slots=True)
class EngineMetrics:
    outcomes: Counter = field(default_factory=Counter)   # finish reason -> requests
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))
    queue: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))  # to first step
    inter_token: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS_S))
    # From a batch's scheduling to its tokens' delivery: the wait behind the steps in flight
    # and the step's own time, which a request admitted into it waits for its first token.
    steps: dict[str, Histogram] = field(
        default_factory=lambda: {kind: Histogram(STEP_BUCKETS_S) for kind in STEP_KINDS})
    prefill_step_tokens: int = 0        # prompt tokens computed by steps, chunk by chunk

    def token(self, seconds_since: float, first: bool, queued: float | None = None) -> None:
        """A request's token: `seconds_since` its submission (first) or its previous token;
        with the first, the seconds it `queued` before its first step was formed."""
        (self.ttft if first else self.inter_token).observe(seconds_since)
        if queued is not None:
            self.queue.observe(queued)
        self.generated_tokens += 1

    def step(self, seconds: float, prefill_tokens: int) -> None:
        """A step's tokens were delivered, `seconds` after its batch was scheduled."""
        self.steps["prefill" if prefill_tokens else "decode"].observe(seconds)
        self.prefill_step_tokens += prefill_tokens

    def finished(self, reason: str, prompt_tokens: int) -> None:
        self.outcomes[reason] += 1
        self.prompt_tokens += prompt_tokens
