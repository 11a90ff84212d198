"""GET /metrics: the engine's counters and the server's gauges in Prometheus text format.

Rendered at scrape time from `Engine.metrics` (requests by outcome, prompt and generated
tokens, time to first token and the part of it queued, inter-token latency, and steps: their time from scheduling to
delivery by kind, and the prompt tokens they computed) and `Engine.stats()` (running and
waiting requests, KV blocks used and free, bytes offloading moved). Each server has a
registry of its own, so several servers in one process never share series.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from astream.base.errors import EngineClosedError
from astream.base.metrics import Histogram
from astream.server.state import ServerState

METRICS_PATH = "/metrics"
METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST


class EngineCollector(Collector):
    def __init__(self, state: ServerState) -> None:
        self.state = state

    def collect(self) -> Iterator:
        metrics = self.state.engine.metrics
        requests = CounterMetricFamily("astream_requests", "Requests ended, by outcome (finish "
                                       "reason: stop, length, abort, error)", labels=["outcome"])
        for outcome, count in sorted(metrics.outcomes.items()):
            requests.add_metric([outcome], count)
        yield requests
        yield CounterMetricFamily("astream_prompt_tokens", "Prompt tokens of ended requests",
                                  value=metrics.prompt_tokens)
        yield CounterMetricFamily("astream_generation_tokens", "Tokens generated",
                                  value=metrics.generated_tokens)
        yield _histogram("astream_time_to_first_token_seconds",
                         "From submission to the first token", metrics.ttft)
        yield _histogram("astream_request_queue_time_seconds", "From submission to the first "
                         "step that computed the request's prompt", metrics.queue)
        yield _histogram("astream_inter_token_latency_seconds",
                         "Between consecutive tokens of a request", metrics.inter_token)
        steps = HistogramMetricFamily("astream_step_seconds", "Engine steps, from forming the "
                                      "batch to delivering its tokens, by kind (prefill: with a "
                                      "prompt chunk of more than one token)", labels=["kind"])
        for kind, histogram in metrics.steps.items():
            steps.add_metric([kind], _buckets(histogram), sum_value=histogram.total)
        yield steps
        yield CounterMetricFamily("astream_prefill_step_tokens", "Prompt tokens computed by "
                                  "steps (a recomputed prompt counts again)",
                                  value=metrics.prefill_step_tokens)
        yield GaugeMetricFamily("astream_connections", "Open websocket connections",
                                value=self.state.connections)
        yield from self._engine_gauges()

    def _engine_gauges(self) -> Iterator:
        try:
            stats = self.state.engine.stats()
        except EngineClosedError:
            stats = None
        up = stats is not None and stats["fault"] is None
        yield GaugeMetricFamily("astream_engine_up", "1 while the engine serves", value=int(up))
        if stats is None:
            return
        yield GaugeMetricFamily("astream_requests_running", "Requests in the running batch",
                                value=stats["running"])
        yield GaugeMetricFamily("astream_requests_waiting", "Requests waiting to be scheduled",
                                value=stats["waiting"])
        blocks = GaugeMetricFamily("astream_kv_blocks", "KV cache blocks (in host memory with "
                                   "offload)", labels=["location", "state"])
        location = "host" if stats["offload"] else "device"
        free = stats["kv_blocks_free"]
        blocks.add_metric([location, "free"], free)
        blocks.add_metric([location, "used"], stats["kv_blocks_total"] - free)
        yield blocks
        if stats["offload"]:
            moved = CounterMetricFamily("astream_offload_bytes", "KV bytes moved between host "
                                        "and device", labels=["direction"])
            moved.add_metric(["host_to_device"], stats["offload_bytes_loaded"])
            moved.add_metric(["device_to_host"], stats["offload_bytes_offloaded"])
            yield moved


def _histogram(name: str, documentation: str, histogram: Histogram) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, documentation, buckets=_buckets(histogram),
                                 sum_value=histogram.total)


def _buckets(histogram: Histogram) -> list[tuple[str, int]]:
    return [("+Inf" if bound == float("inf") else repr(bound), count)
            for bound, count in histogram.cumulative()]


def metrics_registry(state: ServerState) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(state))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
