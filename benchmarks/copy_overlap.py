"""How much host<->device copy time runs under compute, read from a profiler trace.

A copy is hidden for the part of its interval during which some kernel runs on the
GPU. The fraction reported is hidden copy time / total copy time, per direction,
counting only copies of at least `min_bytes` (the KV traffic, not per-step inputs).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, stop in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


def _covered(start: float, stop: float, busy: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(stop, b) - max(start, a)) for a, b in busy if a < stop and b > start)


def _direction(event: dict) -> str | None:
    name = event.get("name", "")
    for tag, label in (("HtoD", "h2d"), ("DtoH", "d2h")):
        if tag in name:
            return label
    return None


def copy_overlap(events: list[dict], min_bytes: int = 1 << 20) -> dict:
    """Chrome-trace events -> {"h2d": {...}, "d2h": {...}, "all": {...}} with copy and hidden ms."""
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events
               if e.get("cat") == "kernel" and e.get("dur", 0) > 0]
    busy = _union(kernels)
    totals = {name: [0.0, 0.0, 0] for name in ("h2d", "d2h")}
    for event in events:
        if event.get("cat") != "gpu_memcpy" or event.get("args", {}).get("bytes", 0) < min_bytes:
            continue
        direction = _direction(event)
        if direction is None:
            continue
        start, stop = event["ts"], event["ts"] + event["dur"]
        totals[direction][0] += stop - start
        totals[direction][1] += _covered(start, stop, busy)
        totals[direction][2] += 1
    totals["all"] = [sum(v[i] for v in totals.values()) for i in range(3)]
    return {name: {"copies": n, "copy_ms": round(total / 1e3, 2), "hidden_ms": round(hidden / 1e3, 2),
                   "hidden_fraction": round(hidden / total, 3) if total else None}
            for name, (total, hidden, n) in totals.items()}


def trace_overlap(prof, min_bytes: int = 1 << 20) -> dict:
    """copy_overlap of a finished torch.profiler.profile (CUDA activity is process-wide,
    so copies and kernels launched from the engine's worker thread are in it)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    return copy_overlap(events, min_bytes)
