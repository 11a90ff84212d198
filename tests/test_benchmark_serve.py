"""benchmarks/serve.py: its metrics on synthetic timings, the Poisson schedule, the workload,
and its two load clients against small fake servers (no engine)."""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import serve  # noqa: E402
from serve_load import (ClientSpec, Request, RequestResult, SseStream, _run,  # noqa: E402
                        arrival_offsets, split_round_robin)


def result(index: int, sent: float, first: float, gaps: list[float], kind: str = "short") -> RequestResult:
    """A finished request: first token at `first`, then one token after each gap; it ends with
    its last token."""
    times = [first]
    for gap in gaps:
        times.append(times[-1] + gap)
    return RequestResult(index, kind, prompt_len=10, max_tokens=len(times), scheduled=sent, sent=sent,
                         first=first, end=times[-1], token_times=times, output_tokens=len(times))


def test_percentile_interpolates_like_numpy():
    values = [float(v) for v in np.random.default_rng(0).exponential(size=101)]
    for q in (0, 1, 50, 90, 99, 99.9, 100):
        assert serve.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert serve.percentile([3.0, 1.0], 50) == 2.0
    assert serve.percentile([7.0], 99) == 7.0
    assert math.isnan(serve.percentile([], 50))


def test_tpot_itl_and_throughput_of_synthetic_requests():
    start = 100.0
    a = result(0, sent=100.0, first=100.5, gaps=[0.1] * 10)          # 11 tokens, ends at 101.5
    b = result(1, sent=101.0, first=101.2, gaps=[0.2, 0.4])           # 3 tokens, ends at 101.8
    one = result(2, sent=100.0, first=101.0, gaps=[])                 # 1 token: no TPOT
    failed = RequestResult(3, "short", 10, 5, scheduled=100.0, sent=100.0, end=103.0, error="HTTP 500")
    assert serve.tpot(a) == pytest.approx(0.1)
    assert serve.tpot(b) == pytest.approx(0.3)
    assert serve.tpot(one) is None
    assert serve.itls(b) == pytest.approx([0.2, 0.4])

    m = serve.summarize([a, b, one, failed], start)
    assert (m["requests"], m["completed"], m["failed"]) == (4, 3, 1)
    assert m["duration_s"] == pytest.approx(3.0)                      # the failed one ends last
    assert m["output_tokens"] == 15
    assert m["output_tok_s"] == pytest.approx(5.0)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["ttft_ms"]["mean"] == pytest.approx(1e3 * (0.5 + 0.2 + 1.0) / 3, abs=1e-3)   # ms, 3 decimals
    assert m["ttft_ms"]["p50"] == pytest.approx(500.0)
    assert m["tpot_ms"]["p50"] == pytest.approx(200.0)                # mean of 100 and 300
    itl = [0.1] * 10 + [0.2, 0.4]
    assert m["itl_ms"]["p50"] == pytest.approx(100.0)
    assert m["itl_ms"]["p99"] == pytest.approx(1e3 * float(np.percentile(itl, 99)), abs=1e-3)
    assert m["itl_ms"]["mean"] == pytest.approx(1e3 * sum(itl) / len(itl), abs=1e-3)


def test_the_engines_own_ttft_and_queue_time_come_from_done_frames():
    a, b = result(0, 0.0, 0.5, [0.1]), result(1, 0.0, 0.3, [0.1])
    a.server_timing = {"ttft_ms": 400.0, "tpot_ms": 100.0, "queue_ms": 250.0}
    m = serve.summarize([a, b], 0.0)                  # b came over a protocol without timing
    assert m["server_ttft_ms"]["p50"] == pytest.approx(400.0)
    assert m["queue_ms"]["p50"] == pytest.approx(250.0)
    assert serve.summarize([b], 0.0)["queue_ms"]["p50"] is None


def test_long_mix_reports_short_and_long_requests_apart():
    results = [result(0, 0.0, 0.1, [0.1]), result(1, 0.0, 2.0, [0.1], kind="long"),
               result(2, 0.0, 0.3, [0.1])]
    summary = serve.summarize_run(results, 0.0)
    assert list(summary) == ["all", "short", "long", "during"]
    assert summary["during"]["requests"] == 2       # both short ones were sent before 2.0
    assert summary["short"]["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert summary["long"]["ttft_ms"]["p50"] == pytest.approx(2000.0)
    assert (summary["short"]["duration_s"], summary["all"]["duration_s"]) == (0.4, 2.1)
    assert list(serve.summarize_run(results[:1], 0.0)) == ["all"]


def test_poisson_schedule_is_seeded_with_the_right_mean_rate():
    offsets = arrival_offsets(20000, 8.0, seed=3)
    assert offsets[0] == 0.0
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert min(gaps) >= 0
    assert statistics.fmean(gaps) == pytest.approx(1 / 8.0, rel=0.03)
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.05)   # exponential
    assert arrival_offsets(50, 8.0, seed=3) == offsets[:50]
    assert arrival_offsets(50, 8.0, seed=4) != offsets[:50]
    assert arrival_offsets(5, math.inf, seed=0) == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_offsets(5, 0.0, seed=0)


def test_workload_lengths_are_fixed_and_token_ids_fresh_per_run():
    work = serve.Workload("long-mix", num_requests=20, input_len=(5, 9), output_len=(2, 4), long_requests=3,
                          long_input_len=50, long_output_len=7, token_range=(100, 200), seed=1)
    first, second = work.requests(10), work.requests(11)
    assert [(r.kind, len(r.prompt), r.max_tokens) for r in first] == \
           [(r.kind, len(r.prompt), r.max_tokens) for r in second]
    assert [r.prompt for r in first] != [r.prompt for r in second]
    assert [r.index for r in first] == list(range(23))
    assert sum(r.kind == "long" for r in first) == 3
    assert all(len(r.prompt) == 50 and r.max_tokens == 7 for r in first if r.kind == "long")
    assert all(5 <= len(r.prompt) <= 9 and 2 <= r.max_tokens <= 4 for r in first if r.kind == "short")
    assert all(100 <= t < 200 for r in first for t in r.prompt)
    parts = split_round_robin(first, 4)
    assert [r.index for r in parts[1]] == [1, 5, 9, 13, 17, 21]
    assert len(split_round_robin(first[:2], 4)) == 2


def test_flags_pick_presets_unless_given():
    args = serve.build_parser().parse_args(["--smoke", "--output-len", "3", "5"])
    work = serve.build_workload(args)
    assert (work.num_requests, work.input_len, work.output_len, work.long_requests) == \
           (8, (16, 64), (3, 5), 0)
    args = serve.build_parser().parse_args(["--workload", "long-mix", "--request-rate", "inf", "2.5"])
    work = serve.build_workload(args)
    assert (work.num_requests, work.long_requests, work.long_input_len) == (128, 8, 16384)
    assert args.request_rate == [math.inf, 2.5]


def test_sse_stream_splits_events_across_chunks():
    res = RequestResult(0, "short", 3, 4, scheduled=0.0, sent=0.0)
    stream = SseStream(res)
    text = (': prefill {"prefilled": 0, "total": 3}\r\n\r\n'
            'data: {"choices": [{"text": "a", "finish_reason": null}]}\r\n\r\n'
            'data: {"choices": [{"text": "", "finish_reason": null}]}\n\n'
            'data: {"choices": [{"text": "bc", "finish_reason": null}]}\n\n'
            'data: {"choices": [{"text": "", "finish_reason": "length"}]}\n\n'
            'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}\n\n'
            'data: [DONE]\n\n').encode()
    for n, at in enumerate(range(0, len(text), 7)):                 # cut anywhere, even in a CRLF
        stream.feed(text[at:at + 7], float(n))
    assert stream.finished and res.error is None
    assert res.output_tokens == 4
    assert len(res.token_times) == 2 and res.first == res.token_times[0]
    assert res.end is not None and res.end > res.token_times[-1]


# ---- the clients against fake servers ---------------------------------------------------------

def run_client(spec: ClientSpec) -> list[RequestResult]:
    """_run in this process, with a thread playing the parent: it answers "ready" with a start."""
    ours, theirs = mp.Pipe()

    def parent() -> None:
        assert ours.recv() == "ready"
        ours.send(time.perf_counter() + 0.05)

    thread = threading.Thread(target=parent)
    thread.start()
    report = asyncio.run(_run(spec, theirs))
    thread.join()
    assert report.cpu_s >= 0 and report.wall_s > 0
    return report.results


def requests(n: int) -> list[Request]:
    return [Request(i, [100 + i] * 5, max_tokens=3 + i % 3, offset=0.01 * i) for i in range(n)]


def test_ws_client_multiplexes_requests_on_connections():
    from websockets.asyncio.server import serve as ws_serve

    seen: dict[str, int] = {}

    async def handler(ws) -> None:
        seen[str(id(ws))] = 0

        async def answer(frame: dict) -> None:
            n = frame["params"]["max_tokens"]
            for i in range(n):
                await asyncio.sleep(0.002)
                await ws.send(json.dumps({"type": "token", "id": frame["id"], "index": i,
                                          "token_id": 7, "text": "x"}))
            await ws.send(json.dumps({"type": "done", "id": frame["id"], "finish_reason": "length",
                                      "usage": {"prompt_tokens": 5, "completion_tokens": n}}))

        tasks = []
        async for message in ws:
            frame = json.loads(message)
            assert frame["params"]["ignore_eos"] is True and isinstance(frame["prompt"], list)
            seen[str(id(ws))] += 1
            tasks.append(asyncio.create_task(answer(frame)))
        await asyncio.gather(*tasks)

    async def main() -> list[RequestResult]:
        async with ws_serve(handler, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            spec = ClientSpec(0, "ws", f"http://127.0.0.1:{port}", requests(7), ws_requests_per_connection=3)
            return await asyncio.to_thread(run_client, spec)

    results = asyncio.run(main())
    assert sorted(seen.values()) == [2, 2, 3]                        # 7 requests on 3 connections
    assert all(r.error is None for r in results)
    assert [r.output_tokens for r in results] == [3 + i % 3 for i in range(7)]
    assert all(len(r.token_times) == r.output_tokens and r.sent <= r.first <= r.end for r in results)
    assert all(r.sent >= r.scheduled for r in results)


def test_openai_client_reads_chunked_sse_and_survives_closed_keepalive():
    bodies: list[dict] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            body = json.loads(await reader.readexactly(length))
            bodies.append(body)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            events = [f'data: {{"choices": [{{"text": "t{i}", "finish_reason": null}}]}}\n\n'
                      for i in range(body["max_tokens"])]
            events += ['data: {"choices": [{"text": "", "finish_reason": "length"}]}\n\n',
                       f'data: {{"choices": [], "usage": {{"completion_tokens": {body["max_tokens"]}}}}}\n\n',
                       "data: [DONE]\n\n"]
            for event in events:
                for part in (event[:5], event[5:]):                  # events split over chunks
                    data = part.encode()
                    writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                await writer.drain()
                await asyncio.sleep(0.001)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            if len(bodies) % 2:                                       # an idle connection timing out
                writer.close()
                return

    async def main() -> list[RequestResult]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        async with server:
            port = server.sockets[0].getsockname()[1]
            spec = ClientSpec(0, "openai", f"http://127.0.0.1:{port}", requests(5), model="m",
                              max_concurrency=1)
            return await asyncio.to_thread(run_client, spec)

    results = asyncio.run(main())
    assert [r.error for r in results] == [None] * 5
    assert [r.output_tokens for r in results] == [3 + i % 3 for i in range(5)]
    assert all(len(r.token_times) == r.output_tokens for r in results)
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} and b["ignore_eos"]
               and b["model"] == "m" for b in bodies)


@pytest.mark.slow
def test_smoke_run_against_a_started_server(tmp_path):
    out = tmp_path / "serve.json"
    result = serve.main(["--smoke", "--num-requests", "4", "--output-len", "4", "6", "--request-rate",
                         "inf", "--warmup", "0", "--clients", "2", "--out", str(out)])
    assert json.loads(out.read_text())["runs"] == result["runs"]
    assert [(run["protocol"], run["metrics"]["all"]["completed"]) for run in result["runs"]] == \
           [("ws", 4), ("openai", 4)]


def test_rounds_summary_gives_spread_and_ratio_to_the_offline_median():
    def run(protocol: str, tok_s: float, ttft: float) -> dict:
        metrics = {"all": {"output_tok_s": tok_s, "ttft_ms": {"p50": ttft}}}
        return {"protocol": protocol, "rate": "inf", "metrics": metrics, "vs_offline": round(tok_s / 100.0, 3)}

    runs = [run("ws", 90.0, 5.0), run("openai", 80.0, 6.0), run("ws", 110.0, 7.0), run("ws", 95.0, 3.0)]
    offline = {"output_tok_s": 100.0, "rounds": [{}, {}, {}],
               "output_tok_s_spread": serve.spread([98.0, 100.0, 104.0])}
    ws, openai, off = serve.summarize_rounds(runs, offline)
    assert (ws["rounds"], ws["output_tok_s"]) == (3, {"min": 90.0, "median": 95.0, "max": 110.0})
    assert ws["vs_offline"] == {"min": 0.9, "median": 0.95, "max": 1.1}
    assert ws["ttft_p50_ms_all"] == {"min": 3.0, "median": 5.0, "max": 7.0}
    assert openai["rounds"] == 1 and openai["vs_offline"]["median"] == 0.8
    assert off == {"protocol": "offline", "rate": "-", "rounds": 3,
                   "output_tok_s": {"min": 98.0, "median": 100.0, "max": 104.0}}


def test_rounds_repeat_runs_and_the_offline_workload(tmp_path):
    result = serve.main(["--smoke", "--num-requests", "2", "--output-len", "3", "3", "--protocol", "openai",
                         "--rounds", "2", "--warmup-rounds", "1", "--warmup", "0", "--clients", "1",
                         "--offline", "--out", str(tmp_path / "serve.json")])
    assert [(run["round"], run["metrics"]["all"]["completed"]) for run in result["runs"]] == [(0, 2), (1, 2)]
    assert len(result["offline"]["rounds"]) == 2
    assert all(r["output_tokens"] == 6 for r in result["offline"]["rounds"])
    assert result["summary"][0]["vs_offline"]["min"] > 0
    for run in result["runs"]:                 # 2 prompts, 3 tokens each: 2 from decode steps
        steps = run["engine_steps"]
        assert steps["prefill"]["steps"] >= 1 and steps["prefill_tokens"] >= 2 * 16
        assert 2 <= steps["decode"]["steps"] <= 4 and steps["decode"]["mean_ms"] > 0


def test_step_delta_of_two_scrapes():
    def scrape(prefill: tuple, decode: tuple, tokens: float) -> dict:
        def kind(count, total, buckets):
            return {"count": count, "sum": total, "buckets": dict(zip((0.01, 0.1, math.inf), buckets))}
        return {"prefill_tokens": tokens, "prefill": kind(*prefill), "decode": kind(*decode)}

    before = scrape((1, 0.05, (0, 1, 1)), (10, 0.05, (10, 10, 10)), 100.0)
    after = scrape((3, 0.45, (0, 2, 3)), (30, 0.15, (28, 30, 30)), 900.0)
    delta = serve.step_delta(before, after)
    assert delta["prefill_tokens"] == 800
    assert delta["prefill"] == {"steps": 2, "mean_ms": 200.0, "p50_under_ms": 100.0, "p90_under_ms": None}
    assert delta["decode"] == {"steps": 20, "mean_ms": 5.0, "p50_under_ms": 10.0, "p90_under_ms": 10.0}
    assert serve.step_delta(None, after) is None
