"""How much host<->device copy time runs under compute, read from a profiler trace.

A copy is hidden for the part of its interval during which some kernel runs on the
GPU. The fraction reported is hidden copy time / total copy time, per direction,
counting only copies of at least `min_bytes` (the KV traffic, not per-step inputs).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path


def union_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
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
    """Chrome-trace events -> {"h2d": {...}, "d2h": {...}, "all": {...}}: copies, bytes, copy
    and hidden ms, the copies' own bandwidth, and (per direction) time shared with the other."""
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events
               if e.get("cat") == "kernel" and e.get("dur", 0) > 0]
    busy = union_intervals(kernels)
    copies: dict[str, list[tuple[float, float, int]]] = {"h2d": [], "d2h": []}
    for event in events:
        nbytes = event.get("args", {}).get("bytes", 0)
        direction = _direction(event) if event.get("cat") == "gpu_memcpy" else None
        if direction is not None and nbytes >= min_bytes:
            copies[direction].append((event["ts"], event["ts"] + event["dur"], nbytes))
    spans = {name: union_intervals([(a, b) for a, b, _ in found]) for name, found in copies.items()}
    result = {}
    for name, found in (*copies.items(), ("all", copies["h2d"] + copies["d2h"])):
        other = spans["d2h" if name == "h2d" else "h2d"] if name != "all" else []
        result[name] = _summary(found, busy, other)
    return result


def _summary(copies: list[tuple[float, float, int]], busy, other) -> dict:
    total = sum(b - a for a, b, _ in copies)
    hidden = sum(_covered(a, b, busy) for a, b, _ in copies)
    nbytes = sum(n for _, _, n in copies)
    return {"copies": len(copies), "gb": round(nbytes / 1e9, 2), "copy_ms": round(total / 1e3, 2),
            "hidden_ms": round(hidden / 1e3, 2),
            "hidden_fraction": round(hidden / total, 3) if total else None,
            "copy_GBps": round(nbytes / total / 1e3, 1) if total else None,
            "concurrent_with_other_direction_ms":
                round(sum(_covered(a, b, other) for a, b, _ in copies) / 1e3, 2)}


def trace_events(prof) -> list[dict]:
    """The chrome-trace events of a finished torch.profiler.profile. CUDA activity is
    process-wide, so work launched by any thread is in them."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text()).get("traceEvents", [])


def trace_overlap(prof) -> dict:
    """copy_overlap of a finished profile, for KV-sized copies (>= 1 MiB) and for all copies."""
    events = trace_events(prof)
    return {"kv_copies": copy_overlap(events), "all_copies": copy_overlap(events, min_bytes=0)}
