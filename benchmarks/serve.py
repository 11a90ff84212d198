"""Serving benchmark: astream serve under load, over astream-ws/1 and the OpenAI HTTP API.

Workloads: "random" (prompts of uniform random 100..1024 token ids, outputs uniform
100..1024 tokens with ignore_eos) and "long-mix" (short requests with a few 16K-token
prompts among them, which all arrive at the start; the short requests' TTFT is reported
apart, which shows fairness).
Requests arrive all at once (--request-rate inf) or as a seeded Poisson process, from
--clients load processes that share one start time; each process reports its CPU time,
so a reader can see the client was not the bottleneck. Per run: output tok/s, requests/s,
TTFT, TPOT ((end - first token) / (tokens - 1) per request) and ITL (every gap between
token events); over astream-ws/1 also the engine's own TTFT and the part of it a request
queued before its first step was formed (each done frame's `timing`), which split a slow
first token into waiting for a step and the steps themselves. --offline adds
LLM.generate on the same workload in its own process, and the ratio of each run's output
tok/s to it.

Rounds: --rounds R measures every (rate, protocol) run R times, interleaved, and the
offline process generates the workload R times too; --warmup-rounds W runs W more rounds
first on both sides, unmeasured. A run of a few seconds swings with the host between
processes, so a ratio of one server run to one offline run is noise; the summary gives each
side's min / median / max over the rounds and each round's ratio to the offline median.

Engine steps: around each run the script reads the server's /metrics, and records what the
run's steps were (`engine_steps`): per kind (prefill: with a prompt chunk of more than one
token; decode), how many, their mean time from scheduling to delivery and the bucket bounds
their p50 and p90 fall under, and the prompt tokens they computed. A slow run shows there
whether its steps were slower or more numerous.

    python benchmarks/serve.py --smoke                                   # CPU, embedded model
    python benchmarks/serve.py --model /models/qwen.gguf --request-rate inf 32 8 --offline
    python benchmarks/serve.py --url http://127.0.0.1:8765 --protocol ws    # a running server

Each run uses fresh token ids (same lengths), so no run finds another's prompts in the
prefix cache. Without --url the script starts `astream serve` on a free port (its log in
--server-log) and stops it with SIGTERM at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))          # the checkout's astream, for --offline and the server

from serve_load import (ClientReport, ClientSpec, Request, RequestResult, arrival_offsets,  # noqa: E402
                        client_main, split_round_robin)
SMOKE_DIR = Path("/tmp/astream-smoke")
# The server's view of the engine's metrics is at most 0.25 s old (server.engine_process).
STATS_DELAY_S = 0.3

# Full-size defaults, and the CPU smoke run's (the embedded SmolLM2, context 8192).
DEFAULTS = {"random": dict(num_requests=256, input_len=(100, 1024), output_len=(100, 1024)),
            "long-mix": dict(num_requests=128, input_len=(32, 256), output_len=(32, 256), long_requests=8,
                             long_input_len=16384, long_output_len=128)}
SMOKE = {"random": dict(num_requests=8, input_len=(16, 64), output_len=(8, 16)),
         "long-mix": dict(num_requests=8, input_len=(16, 64), output_len=(8, 16), long_requests=2,
                          long_input_len=512, long_output_len=8)}


# ---- metrics ----------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def tpot(result: RequestResult) -> float | None:
    """Seconds per output token after the first; None with fewer than two tokens."""
    if result.first is None or result.end is None or result.output_tokens < 2:
        return None
    return (result.end - result.first) / (result.output_tokens - 1)


def itls(result: RequestResult) -> list[float]:
    times = result.token_times
    return [b - a for a, b in zip(times, times[1:])]


def spread(values: list[float]) -> dict:
    """min / median / max of a figure over rounds."""
    if not values:
        return {"min": None, "median": None, "max": None}
    return {"min": round(min(values), 3), "median": round(percentile(values, 50), 3),
            "max": round(max(values), 3)}


def _stats_ms(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    return {"mean": round(1e3 * sum(values) / len(values), 3), "p50": round(1e3 * percentile(values, 50), 3),
            "p99": round(1e3 * percentile(values, 99), 3)}


def summarize(results: list[RequestResult], start: float) -> dict:
    """Throughputs over the run (from the shared start to the last request's end) and latency
    statistics of the requests that succeeded; milliseconds for latencies."""
    ok = [r for r in results if r.error is None and r.end is not None]
    ends = [r.end for r in results if r.end is not None]
    duration = max(ends) - start if ends else math.nan
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_len for r in ok)
    per_s = (lambda x: round(x / duration, 3)) if duration > 0 else (lambda x: None)
    return {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": round(duration, 3), "output_tokens": output, "prompt_tokens": prompt,
        "request_throughput": per_s(len(ok)), "output_tok_s": per_s(output),
        "total_tok_s": per_s(output + prompt),
        "ttft_ms": _stats_ms([r.first - r.sent for r in ok if r.first is not None]),
        "tpot_ms": _stats_ms([t for r in ok if (t := tpot(r)) is not None]),
        "itl_ms": _stats_ms([gap for r in ok for gap in itls(r)]),
        "e2e_ms": _stats_ms([r.end - r.sent for r in ok]),
        "send_lag_ms": _stats_ms([r.sent - r.scheduled for r in results if not math.isnan(r.sent)]),
        # astream-ws/1 only: the engine's own view, from submission (after the frame was read)
        "server_ttft_ms": _stats_ms(_server_s(ok, "ttft_ms")),
        "queue_ms": _stats_ms(_server_s(ok, "queue_ms")),
    }


def _server_s(results: list[RequestResult], key: str) -> list[float]:
    """Seconds of one field of the engine's timing, where the protocol reported it."""
    return [r.server_timing[key] / 1e3 for r in results
            if r.server_timing and r.server_timing.get(key) is not None]


def summarize_run(results: list[RequestResult], start: float) -> dict:
    """The whole run, and with long-mix, short and long requests apart (each class's duration
    ends with its own last request), and "during": the short requests sent before the last
    long prompt's first token, which met the long prefills."""
    summary = {"all": summarize(results, start)}
    kinds = {r.kind for r in results}
    if len(kinds) > 1:
        for kind in sorted(kinds, key=("short", "long").index):
            summary[kind] = summarize([r for r in results if r.kind == kind], start)
        long_firsts = [r.first for r in results if r.kind == "long" and r.first is not None]
        if long_firsts:
            during = [r for r in results if r.kind == "short" and r.sent < max(long_firsts)]
            summary["during"] = summarize(during, start)
    return summary


# ---- workload ------------------------------------------------------------------------------------

@dataclass(slots=True)
class Workload:
    name: str
    num_requests: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    long_requests: int = 0
    long_input_len: int = 16384
    long_output_len: int = 128
    token_range: tuple[int, int] = (100, 32000)
    seed: int = 0

    def shapes(self) -> list[tuple[str, int, int]]:
        """(kind, prompt length, output length) per request; fixed by the seed, so every run
        and the offline baseline see the same lengths. Long requests sit at seeded positions."""
        rng = random.Random(self.seed)
        shapes = [("short", rng.randint(*self.input_len), rng.randint(*self.output_len))
                  for _ in range(self.num_requests)]
        for _ in range(self.long_requests):
            shapes.insert(rng.randint(0, len(shapes)), ("long", self.long_input_len, self.long_output_len))
        return shapes

    def requests(self, content_seed: int) -> list[Request]:
        """The requests with token ids drawn from content_seed: a fresh seed per run keeps one
        run's prompts out of the next one's prefix cache."""
        rng = random.Random(content_seed)
        lo, hi = self.token_range
        return [Request(i, [rng.randrange(lo, hi) for _ in range(length)], out, kind=kind)
                for i, (kind, length, out) in enumerate(self.shapes())]


def build_workload(args: argparse.Namespace) -> Workload:
    preset = (SMOKE if args.smoke else DEFAULTS)[args.workload]
    picked = {key: getattr(args, key) if getattr(args, key) is not None else preset.get(key)
              for key in ("num_requests", "input_len", "output_len", "long_requests",
                          "long_input_len", "long_output_len")}
    if args.workload == "random":
        picked["long_requests"] = 0
    picked = {k: tuple(v) if isinstance(v, list) else v for k, v in picked.items() if v is not None}
    for key in ("input_len", "output_len"):
        lo, hi = picked[key]
        if not 1 <= lo <= hi:
            raise SystemExit(f"--{key.replace('_', '-')} needs 1 <= LO <= HI, got {lo} {hi}")
    return Workload(args.workload, token_range=tuple(args.token_range), seed=args.seed,
                    **{k: v for k, v in picked.items() if k in Workload.__slots__})


# ---- the server --------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get_json(url: str, api_key: str | None = None, timeout: float = 5.0) -> tuple[int, dict]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {}


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@contextmanager
def started_server(model: str | None, serve_args: list[str], log: Path, timeout: float,
                   api_key: str | None) -> Iterator[str]:
    """`astream serve` on a free port, its output in `log`; yields its http:// URL once /health
    answers 200 "ok", and stops it with SIGTERM (SIGKILL if it lingers) on the way out."""
    port = free_port()
    command = [sys.executable, "-c", "import sys; from astream.face.cli import main; sys.exit(main(sys.argv[1:]))",
               "serve", "--port", str(port), *(["--model", model] if model else []), *serve_args]
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    if api_key:
        env["ASTREAM_API_KEY"] = api_key              # out of `ps`
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"starting: astream {shlex.join(command[3:])}  (log: {log})", flush=True)
    with open(log, "wb") as out:
        # Its own session: a Ctrl-C here reaches the server only through the SIGTERM below.
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"astream serve exited with status {proc.returncode} before it "
                                 f"answered /health; the end of {log}:\n{_log_tail(log)}")
            try:
                status, body = get_json(f"{url}/health", timeout=2.0)
                if status == 200 and body.get("status") == "ok":
                    break
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"astream serve did not answer /health with 200 within {timeout:g} s; "
                                 f"the end of {log}:\n{_log_tail(log)}")
            time.sleep(0.5)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        print(f"astream serve stopped (status {proc.returncode})", flush=True)


def wait_idle(url: str, timeout: float = 120.0) -> dict:
    """Poll /health until nothing runs or waits, so one run's tail does not overlap the next."""
    deadline, body = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        try:
            status, body = get_json(f"{url}/health")
        except (OSError, ValueError):
            status = 0
        if status == 200 and not any(body.get(k) for k in ("live_requests", "running", "waiting")):
            return body
        time.sleep(0.2)
    print(f"warning: the server was not idle after {timeout:g} s: {body}", file=sys.stderr)
    return body


def engine_steps(url: str, api_key: str | None) -> dict | None:
    """The engine's step counters from /metrics: per kind, steps, their seconds and histogram
    buckets; and the prompt tokens steps computed. None where the server has none."""
    from prometheus_client.parser import text_string_to_metric_families

    request = urllib.request.Request(f"{url}/metrics",
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=5.0) as response:
            text = response.read().decode()
    except (OSError, ValueError):
        return None
    steps: dict = {"prefill_tokens": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            kind = sample.labels.get("kind")
            if sample.name == "astream_prefill_step_tokens_total":
                steps["prefill_tokens"] = sample.value
            elif sample.name.startswith("astream_step_seconds") and kind:
                entry = steps.setdefault(kind, {"count": 0.0, "sum": 0.0, "buckets": {}})
                if sample.name.endswith("_count"):
                    entry["count"] = sample.value
                elif sample.name.endswith("_sum"):
                    entry["sum"] = sample.value
                elif sample.name.endswith("_bucket"):
                    entry["buckets"][float(sample.labels["le"])] = sample.value
    return steps if len(steps) > 1 else None


def step_delta(before: dict | None, after: dict | None) -> dict | None:
    """What one pass's steps were: per kind, how many, their mean, and the bucket bounds their
    p50 and p90 fall under (scheduling to delivery, ms); the prompt tokens they computed."""
    if before is None or after is None:
        return None
    out = {"prefill_tokens": int(after["prefill_tokens"] - before["prefill_tokens"])}
    for kind in ("prefill", "decode"):
        a, b = after.get(kind), before.get(kind, {"count": 0.0, "sum": 0.0, "buckets": {}})
        if a is None:
            continue
        count = a["count"] - b["count"]
        bounds = sorted(a["buckets"])
        cumulative = [a["buckets"][x] - b["buckets"].get(x, 0.0) for x in bounds]

        def under(q: float) -> float | None:
            hit = next((x for x, c in zip(bounds, cumulative) if c >= q * count), None)
            return None if hit is None or hit == math.inf else round(1e3 * hit, 1)

        out[kind] = {"steps": int(count),
                     "mean_ms": round(1e3 * (a["sum"] - b["sum"]) / count, 2) if count else None,
                     "p50_under_ms": under(0.5) if count else None,
                     "p90_under_ms": under(0.9) if count else None}
    return out


def step_text(steps: dict) -> str:
    parts = [f"{kind} {v['steps']} (mean {v['mean_ms']} ms, p50 <= {v['p50_under_ms']}, "
             f"p90 <= {v['p90_under_ms']})" for kind, v in steps.items() if isinstance(v, dict)]
    return "; ".join(parts) + f"; prompt tokens computed {steps['prefill_tokens']}"


def served_model(url: str, api_key: str | None) -> str | None:
    try:
        status, body = get_json(f"{url}/v1/models", api_key)
        return body["data"][0]["id"] if status == 200 else None
    except (OSError, ValueError, KeyError, IndexError):
        return None


# ---- one load run ------------------------------------------------------------------------------

def run_load(protocol: str, url: str, requests: list[Request], args: argparse.Namespace,
             model: str | None) -> tuple[list[RequestResult], list[ClientReport], float]:
    """Send `requests` from --clients spawned processes; (results by index, reports, start)."""
    # With a concurrency cap below --clients, fewer processes: each needs a share of at least one.
    parts = split_round_robin(requests, max(1, min(args.clients, args.max_concurrency or args.clients)))
    concurrency = None
    if args.max_concurrency:
        concurrency = [args.max_concurrency // len(parts) + (i < args.max_concurrency % len(parts))
                       for i in range(len(parts))]
    ctx = mp.get_context("spawn")
    procs, pipes = [], []
    for i, part in enumerate(parts):
        spec = ClientSpec(i, protocol, url, part, args.api_key, model, args.temperature, args.seed,
                          concurrency[i] if concurrency else None, args.ws_requests_per_connection,
                          args.request_timeout)
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=client_main, args=(spec, theirs), daemon=True)
        proc.start()
        procs.append(proc)
        pipes.append(ours)
    try:
        for pipe in pipes:
            _expect(pipe, str, 120.0, "ready")
        start = time.perf_counter() + 0.2                 # every process is waiting by then
        for pipe in pipes:
            pipe.send(start)
        reports = [_expect(pipe, ClientReport, args.request_timeout + 60, "its results") for pipe in pipes]
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
    results = sorted((r for report in reports for r in report.results), key=lambda r: r.index)
    return results, reports, start


def _expect(pipe, kind: type, timeout: float, what: str):
    if not pipe.poll(timeout):
        raise SystemExit(f"a client process sent no {what} within {timeout:g} s")
    message = pipe.recv()
    if isinstance(message, str) and message != "ready":
        raise SystemExit(message)
    if not isinstance(message, kind):
        raise SystemExit(f"a client process sent {message!r} instead of {what}")
    return message


def client_usage(reports: list[ClientReport]) -> list[dict]:
    return [{"worker": r.worker, "requests": len(r.results), "cpu_s": round(r.cpu_s, 3),
             "wall_s": round(r.wall_s, 3), "cpu_util": round(r.cpu_s / r.wall_s, 3) if r.wall_s else None,
             "max_rss_mib": round(r.max_rss_mib, 1)} for r in reports]


def _rate_text(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


# ---- offline baseline ------------------------------------------------------------------------

def engine_options(model: str | None, serve_args: list[str]) -> tuple[str | None, dict]:
    """The engine settings `astream serve` would take from these arguments (server options
    dropped), parsed by astream's own command line so both sides run the same engine."""
    import dataclasses

    from astream.base.config import EngineConfig
    from astream.face.cli import build_parser

    args = build_parser().parse_args(["serve", *(["--model", model] if model else []), *serve_args])
    model = getattr(args, "served_model", None) or args.model
    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
              if f.name != "model" and hasattr(args, f.name)}
    return model, kwargs


def offline_main(model: str | None, serve_args: list[str], rounds: list[list[Request]], measured: int,
                 temperature: float, seed: int, warmup: int, pipe) -> None:
    """LLM.generate over each round's workload in one call a round (the rounds before the
    last `measured` unmeasured); sends back a dict of the measured rounds' figures."""
    try:
        from astream import LLM, SamplingParams

        model, kwargs = engine_options(model, serve_args)
        t0 = time.perf_counter()
        llm = LLM(model, **kwargs)
        load_s = time.perf_counter() - t0

        def params(r: Request) -> SamplingParams:
            return SamplingParams(max_tokens=r.max_tokens, temperature=temperature, ignore_eos=True,
                                  seed=seed + r.index if temperature > 0 else None)

        if warmup:
            warm = rounds[0][:warmup]
            llm.generate([r.prompt[:64] for r in warm],
                         [SamplingParams(max_tokens=4, ignore_eos=True)] * len(warm))
        figures = []
        for requests in rounds:
            t0 = time.perf_counter()
            completions = llm.generate([r.prompt for r in requests], [params(r) for r in requests])
            seconds = time.perf_counter() - t0
            output = sum(len(c.token_ids) for c in completions)
            prompt = sum(len(r.prompt) for r in requests)
            figures.append({"duration_s": round(seconds, 3), "output_tokens": output,
                            "output_tok_s": round(output / seconds, 3),
                            "total_tok_s": round((output + prompt) / seconds, 3),
                            "request_throughput": round(len(requests) / seconds, 3),
                            "failed": sum(c.finish_reason not in ("length", "stop") for c in completions)})
        llm.close()
        figures = figures[len(figures) - measured:]
        median = sorted(figures, key=lambda f: f["output_tok_s"])[(len(figures) - 1) // 2]
        pipe.send({"requests": len(rounds[0]), "load_s": round(load_s, 2), **median,
                   "rounds": figures, "output_tok_s_spread": spread([f["output_tok_s"] for f in figures]),
                   "engine": {k: v for k, v in kwargs.items() if isinstance(v, (str, int, float, bool))}})
    except BaseException as exc:
        pipe.send(f"offline run failed: {type(exc).__name__}: {exc}")
        raise


def run_offline(args: argparse.Namespace, serve_args: list[str], rounds: list[list[Request]]) -> dict:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=offline_main, args=(args.model, serve_args, rounds, args.rounds,
                                                  args.temperature, args.seed, args.warmup, theirs))
    proc.start()
    try:
        if not ours.poll(args.request_timeout * len(rounds) + args.server_timeout):
            raise SystemExit("the offline run sent nothing back in time")
        result = ours.recv()
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.terminate()
    if isinstance(result, str):
        raise SystemExit(result)
    return result


def measure_run(protocol: str, rate: float, url: str, workload: "Workload", args: argparse.Namespace,
                model_name: str | None, run_no: int) -> dict:
    """One run of the workload with fresh token ids: long prompts all arrive at the start,
    the background every short request meets; short ones arrive at the request rate."""
    requests = workload.requests(args.seed * 1_000_003 + run_no)
    offsets = iter(arrival_offsets(len(requests), rate, args.seed + run_no))
    for request in requests:
        request.offset = 0.0 if request.kind == "long" else next(offsets)
    results, reports, start = run_load(protocol, url, requests, args, model_name)
    return {"protocol": protocol, "rate": _rate_text(rate), "metrics": summarize_run(results, start),
            "clients": client_usage(reports), "errors": sorted({r.error for r in results if r.error})[:10]}


def summarize_rounds(runs: list[dict], offline: dict | None) -> list[dict]:
    """Per (protocol, rate), min / median / max over the rounds: output tok/s, its ratio to
    the offline median, and the TTFT p50 of each request class."""
    summary = []
    for key in dict.fromkeys((run["protocol"], run["rate"]) for run in runs):
        group = [run for run in runs if (run["protocol"], run["rate"]) == key]
        row = {"protocol": key[0], "rate": key[1], "rounds": len(group),
               "output_tok_s": spread([r["metrics"]["all"]["output_tok_s"] or 0.0 for r in group])}
        if offline:
            row["vs_offline"] = spread([r["vs_offline"] or 0.0 for r in group])
        for cls in group[0]["metrics"]:
            row[f"ttft_p50_ms_{cls}"] = spread([r["metrics"][cls]["ttft_ms"]["p50"] for r in group
                                                if cls in r["metrics"] and r["metrics"][cls]["ttft_ms"]["p50"]
                                                is not None])
        summary.append(row)
    if offline:
        summary.append({"protocol": "offline", "rate": "-", "rounds": len(offline["rounds"]),
                        "output_tok_s": offline["output_tok_s_spread"]})
    return summary


def print_summary(summary: list[dict]) -> None:
    print("\nover the rounds, min / median / max:")
    for row in summary:
        cells = [f"{key} {v['min']} / {v['median']} / {v['max']}" for key, v in row.items()
                 if isinstance(v, dict) and v["min"] is not None]
        print(f"  {row['protocol']} rate {row['rate']} ({row['rounds']} rounds): " + "; ".join(cells))


# ---- the report ------------------------------------------------------------------------------

COLUMNS = ("protocol", "rate", "class", "ok", "dur s", "req/s", "out tok/s", "TTFT mean", "TTFT p50",
           "TTFT p99", "engine TTFT p50", "queued p50", "TPOT p50", "TPOT p99", "ITL p50", "ITL p99",
           "client CPU", "vs offline")


def table_rows(runs: list[dict], offline: dict | None) -> list[list[str]]:
    def ms(stats: dict, key: str) -> str:
        return "-" if stats[key] is None else f"{stats[key]:.1f}"

    rows = []
    for run in runs:
        cpu = max((c["cpu_util"] or 0.0) for c in run["clients"])
        for cls, m in run["metrics"].items():
            ratio = run.get("vs_offline") if cls == "all" else None
            name = run["protocol"] + (f" r{run['round']}" if run.get("round") else "")
            rows.append([name, run["rate"], cls, f"{m['completed']}/{m['requests']}",
                         f"{m['duration_s']:.2f}", f"{m['request_throughput'] or 0:.2f}",
                         f"{m['output_tok_s'] or 0:.1f}", ms(m["ttft_ms"], "mean"), ms(m["ttft_ms"], "p50"),
                         ms(m["ttft_ms"], "p99"), ms(m["server_ttft_ms"], "p50"),
                         ms(m["queue_ms"], "p50"), ms(m["tpot_ms"], "p50"), ms(m["tpot_ms"], "p99"),
                         ms(m["itl_ms"], "p50"), ms(m["itl_ms"], "p99"),
                         f"{100 * cpu:.1f}%" if cls == "all" else "",
                         "" if ratio is None else f"{ratio:.2f}"])
    if offline:
        ok = offline["requests"] - offline["failed"]
        rows.append(["offline", "-", "all", f"{ok}/{offline['requests']}",
                     f"{offline['duration_s']:.2f}", f"{offline['request_throughput']:.2f}",
                     f"{offline['output_tok_s']:.1f}", *["-"] * 9, "", "1.00"])
    return rows


def print_table(runs: list[dict], offline: dict | None) -> None:
    rows = [list(COLUMNS), *table_rows(runs, offline)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    for n, row in enumerate(rows):
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
        if n == 0:
            print("  ".join("-" * w for w in widths))
    print("latencies in ms; engine TTFT and queued (astream-ws/1 only): the engine's own, from "
          "submission to the first token and to the first step formed; client CPU: the busiest "
          "load process's CPU time / its wall time; vs offline: output tok/s / LLM.generate's")


# ---- main -------------------------------------------------------------------------------------

def parse_rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"a request rate must be > 0 or inf, got {text}")
    return rate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    work = parser.add_argument_group("workload")
    work.add_argument("--workload", choices=("random", "long-mix"), default="random")
    work.add_argument("--num-requests", type=int, help="requests (long-mix: short ones); default 256, "
                      "long-mix 128, --smoke 8")
    work.add_argument("--input-len", type=int, nargs=2, metavar=("LO", "HI"),
                      help="prompt tokens, uniform; default 100 1024 (long-mix 32 256, --smoke 16 64)")
    work.add_argument("--output-len", type=int, nargs=2, metavar=("LO", "HI"),
                      help="output tokens, uniform, ignore_eos; default 100 1024 (long-mix 32 256, "
                      "--smoke 8 16)")
    work.add_argument("--long-requests", type=int, help="long-mix: long prompts (default 8, --smoke 2)")
    work.add_argument("--long-input-len", type=int,
                      help="long-mix: their tokens (default 16384, --smoke 512)")
    work.add_argument("--long-output-len", type=int, help="long-mix: their output (default 128, --smoke 8)")
    work.add_argument("--token-range", type=int, nargs=2, default=(100, 32000), metavar=("LO", "HI"),
                      help="prompt token ids are uniform in [LO, HI): clear of special tokens and "
                      "inside every common vocabulary (default 100 32000)")
    work.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above 0, request i "
                      "gets seed --seed + i")
    work.add_argument("--seed", type=int, default=0, help="lengths, token ids and arrival times")
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=parse_rate, nargs="+", default=[math.inf], metavar="RATE",
                      help="requests/s, Poisson arrivals; inf sends all at once; several: one run each")
    load.add_argument("--protocol", nargs="+", choices=("ws", "openai"), default=["ws", "openai"])
    load.add_argument("--rounds", type=int, default=1, help="measured rounds: every (rate, protocol) "
                      "run, and the offline workload, this many times (default 1)")
    load.add_argument("--warmup-rounds", type=int, default=0, help="unmeasured rounds before them, "
                      "on both sides (default 0)")
    load.add_argument("--clients", type=int, help="load processes (default 4, --smoke 2)")
    load.add_argument("--max-concurrency", type=int, help="requests in flight at most, over all clients")
    load.add_argument("--ws-requests-per-connection", type=int, default=8,
                      help="astream-ws/1 requests multiplexed on one connection; keep it within the "
                      "server's --max-requests-per-connection (default: a quarter of max_num_seqs)")
    load.add_argument("--warmup", type=int, help="short requests sent (and not measured) "
                      "before the runs, and to the offline engine, with one whole long prompt in "
                      "long-mix (default 4, --smoke 2)")
    load.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request")
    server = parser.add_argument_group("server")
    server.add_argument("--url", help="a running server, http://host:port; else one is started")
    server.add_argument("--api-key", default=os.environ.get("ASTREAM_API_KEY"),
                        help="the server's key (default: $ASTREAM_API_KEY)")
    server.add_argument("--model", help="the model the started server (and --offline) loads; "
                        "default: the embedded SmolLM2-135M-Instruct")
    server.add_argument("--serve-args", default="", help="more `astream serve` options for the "
                        "started server and the offline engine, e.g. "
                        "\"--max-num-seqs 256 --max-model-len 20480\"")
    server.add_argument("--device", help="shorthand for --serve-args \"--device DEVICE\"")
    server.add_argument("--server-timeout", type=float, default=600.0,
                        help="seconds the started server has to answer /health")
    server.add_argument("--server-log", type=Path, help="its stdout and stderr "
                        "(default: next to --out, else /tmp/astream-serve.log)")
    parser.add_argument("--offline", action="store_true",
                        help="also run the workload through LLM.generate, after the server stops")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run of the embedded model")
    parser.add_argument("--out", type=Path, help="result JSON (default: $OUT/serve.json on the device "
                        "machine; with --smoke, /tmp/astream-smoke/serve.json)")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.device = args.device or "cpu"
    args.clients = args.clients or (2 if args.smoke else 4)
    args.warmup = (2 if args.smoke else 4) if args.warmup is None else args.warmup
    if args.rounds < 1 or args.warmup_rounds < 0:
        raise SystemExit("--rounds needs >= 1 and --warmup-rounds >= 0")
    workload = build_workload(args)
    serve_args = shlex.split(args.serve_args) + (["--device", args.device] if args.device else [])
    out = args.out or (Path(os.environ["OUT"]) / "serve.json" if os.environ.get("OUT")
                       else SMOKE_DIR / "serve.json" if args.smoke else None)
    log = args.server_log or (out.with_name(out.stem + "-server.log") if out
                              else Path("/tmp/astream-serve.log"))
    shapes = workload.shapes()
    print(f"workload {workload.name}: {len(shapes)} requests, prompts {sum(s[1] for s in shapes)} tokens, "
          f"outputs {sum(s[2] for s in shapes)} tokens; rates {[_rate_text(r) for r in args.request_rate]}, "
          f"protocols {args.protocol}, {args.clients} client processes", flush=True)

    runs, health, model_name = [], {}, None
    with (nullcontext_url(args.url) if args.url else
          started_server(args.model, serve_args, log, args.server_timeout, args.api_key)) as url:
        model_name = served_model(url, args.api_key)
        if args.warmup:
            pool = workload.requests(args.seed + 999_983)
            warm = [Request(r.index, r.prompt[:64], min(r.max_tokens, 8)) for r in pool[:args.warmup]]
            # One whole long prompt too: the first long prefill of a server compiles kernels
            # for its shapes, which no measured request should wait for.
            warm += [Request(r.index, r.prompt, 8, kind="long") for r in pool if r.kind == "long"][:1]
            for protocol in args.protocol:
                run_load(protocol, url, warm, args, model_name)
            wait_idle(url)
        run_no = 0
        for round_no in range(-args.warmup_rounds, args.rounds):
            for rate in args.request_rate:
                for protocol in args.protocol:
                    run_no += 1
                    steps_before = engine_steps(url, args.api_key)
                    run = measure_run(protocol, rate, url, workload, args, model_name, run_no)
                    run["round"] = round_no
                    m = run["metrics"]["all"]
                    print(f"{'warmup' if round_no < 0 else f'round {round_no}'}: {protocol} rate "
                          f"{run['rate']}: {m['completed']}/{m['requests']} ok, {m['output_tok_s']} out tok/s, "
                          f"TTFT p50 {m['ttft_ms']['p50']} ms"
                          + (f"; errors: {run['errors'][:3]}" if run["errors"] else ""), flush=True)
                    health = wait_idle(url)
                    time.sleep(STATS_DELAY_S)
                    run["engine_steps"] = step_delta(steps_before, engine_steps(url, args.api_key))
                    if run["engine_steps"]:
                        print("  engine steps: " + step_text(run["engine_steps"]), flush=True)
                    if round_no >= 0:
                        runs.append(run)

    offline = None
    if args.offline:
        print(f"offline: LLM.generate on the same workload, {args.warmup_rounds} + {args.rounds} rounds",
              flush=True)
        rounds = [workload.requests(args.seed * 1_000_003 - 1 - k)
                  for k in range(args.warmup_rounds + args.rounds)]
        offline = run_offline(args, serve_args, rounds)
        for run in runs:
            tok_s = run["metrics"]["all"]["output_tok_s"]
            median = offline["output_tok_s_spread"]["median"]
            run["vs_offline"] = round(tok_s / median, 3) if tok_s else None
    summary = summarize_rounds(runs, offline)

    print()
    print_table(runs, offline)
    if args.rounds > 1:
        print_summary(summary)
    result = {"benchmark": "serve", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "argv": sys.argv[1:] if argv is None else argv,
              "workload": asdict(workload), "server": {"url": args.url, "started": not args.url,
                                                        "model": args.model, "served_model": model_name,
                                                        "serve_args": serve_args,
                                                        "health_after": health},
              "clients": args.clients, "max_concurrency": args.max_concurrency,
              "rounds": args.rounds, "warmup_rounds": args.warmup_rounds, "summary": summary,
              "runs": runs, "offline": offline}
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2, default=str))
        print(f"wrote {out}")
    return result


@contextmanager
def nullcontext_url(url: str) -> Iterator[str]:
    yield url.rstrip("/")


if __name__ == "__main__":
    main()
