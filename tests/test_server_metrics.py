"""GET /metrics: Prometheus text that prometheus_client parses, counters that move as
requests finish (a disconnected client's abort included), and the API key when one is set."""

from __future__ import annotations

import re
from contextlib import aclosing

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from astream.face.client import Client
from astream.server import ServerOptions, StreamServer
from server_helpers import GREEDY, LONG, OPTIONS, http_get, wait_idle

pytestmark = pytest.mark.anyio


async def scrape(port: int, headers: str = "") -> tuple[int, str, str]:
    """GET /metrics: (status, content type, body)."""
    status, head, body = await http_get(port, "/metrics", headers)
    content_type = next((line.split(":", 1)[1].strip() for line in head.split("\r\n")
                         if line.lower().startswith("content-type:")), "")
    return status, content_type, body


async def samples(port: int) -> dict:
    """{(sample name, sorted labels): value} of one scrape, parsed by prometheus_client."""
    status, content_type, body = await scrape(port)
    assert status == 200 and content_type.startswith("text/plain; version="), (status, content_type)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def value(snapshot: dict, name: str, **labels) -> float:
    return snapshot.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_counters_move_as_requests_finish(server, idle_free):
    before = await samples(server.port)
    assert value(before, "astream_engine_up") == 1
    async with Client(server.url) as client:
        _, done = await client.generate("The quick brown fox", **GREEDY)
        async with aclosing(client.stream("Tell me a long story.", **LONG)) as tokens:
            async for _ in tokens:
                break                                  # leave after the first token: an abort
    await wait_idle(server.port, idle_free)
    after = await samples(server.port)
    usage, finished = done["usage"], done["finish_reason"]
    assert value(after, "astream_requests_total", outcome=finished) == \
        value(before, "astream_requests_total", outcome=finished) + 1
    assert value(after, "astream_requests_total", outcome="abort") == \
        value(before, "astream_requests_total", outcome="abort") + 1
    generated = value(after, "astream_generation_tokens_total") - value(before, "astream_generation_tokens_total")
    assert generated >= usage["completion_tokens"] + 1
    prompts = value(after, "astream_prompt_tokens_total") - value(before, "astream_prompt_tokens_total")
    assert prompts >= usage["prompt_tokens"] + 1
    ttft = "astream_time_to_first_token_seconds_count"
    assert value(after, ttft) == value(before, ttft) + 2
    queued, queued_s = "astream_request_queue_time_seconds_count", "astream_request_queue_time_seconds_sum"
    assert value(after, queued) == value(before, queued) + 2
    ttft_s = "astream_time_to_first_token_seconds_sum"
    assert 0 <= value(after, queued_s) - value(before, queued_s) <= value(after, ttft_s) - value(before, ttft_s)
    itl = "astream_inter_token_latency_seconds_count"
    assert value(after, itl) - value(before, itl) >= usage["completion_tokens"] - 1
    assert value(after, "astream_kv_blocks", location="device", state="free") == idle_free
    assert value(after, "astream_kv_blocks", location="device", state="used") == \
        server.engine.stats()["kv_blocks_total"] - idle_free
    assert value(after, "astream_requests_running") == 0


async def test_steps_are_counted_by_kind_with_the_prompt_tokens_they_computed(server, idle_free):
    before = await samples(server.port)
    prompt = [(7 * i + 11) % 3000 + 100 for i in range(40)]     # token ids no other test sends
    async with Client(server.url) as client:
        _, done = await client.generate(prompt, **GREEDY)
    await wait_idle(server.port, idle_free)
    after = await samples(server.port)

    def delta(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    generated = done["usage"]["completion_tokens"]
    assert delta("astream_step_seconds_count", kind="prefill") == 1      # the 40 tokens at once
    assert delta("astream_prefill_step_tokens_total") == 40
    assert delta("astream_step_seconds_count", kind="decode") >= generated - 1
    assert 0 < delta("astream_step_seconds_sum", kind="decode") < 60


async def test_metrics_ask_for_the_api_key_when_one_is_set(server):
    async with StreamServer(server.engine, ServerOptions(**OPTIONS, api_key="s3cret")) as keyed:
        assert (await scrape(keyed.port))[0] == 401
        assert (await scrape(keyed.port, "Authorization: Bearer wrong\r\n"))[0] == 401
        status, _, body = await scrape(keyed.port, "Authorization: Bearer s3cret\r\n")
        assert status == 200 and "astream_requests_total" in body


async def test_one_log_line_per_finished_request_without_the_prompt(server, caplog):
    secret = "The quick brown fox"
    with caplog.at_level("INFO", logger="astream.requests"):
        async with Client(server.url) as client:
            _, done = await client.generate(secret, **GREEDY)
        with anyio.fail_after(5):
            while not caplog.records:
                await anyio.sleep(0.01)
    lines = [r.getMessage() for r in caplog.records if r.name == "astream.requests"]
    assert len(lines) == 1, lines
    usage = done["usage"]
    assert f"{done['finish_reason']}: prompt {usage['prompt_tokens']} tokens, generated " \
           f"{usage['completion_tokens']}, ttft " in lines[0]
    logged = re.search(r"ttft (\d+) ms \(queued (\d+) ms\)", lines[0])
    assert logged and int(logged[2]) <= int(logged[1])           # the queued part of the first token
    assert abs(int(logged[1]) - done["timing"]["ttft_ms"]) <= 1
    assert "tok/s" in lines[0] and secret not in lines[0] and "quick" not in lines[0]


def test_log_level_is_checked():
    assert ServerOptions(log_level="warning").log_level == "warning"
    with pytest.raises(ValueError, match="log_level must be one of debug, info, warning, error"):
        ServerOptions(log_level="loud")
