"""Triton's once-a-process cost, moved off the load's critical path.

The first Triton kernel a process looks up makes Triton compute its cache key: a SHA-256
of its own shared library (400-500 MB), 0.35 s on the H200 machine. The hash reads a
file and runs in hashlib, both of which release the GIL, so a thread started before the
weights load computes it while they load. Triton memoizes the key, so the kernels' first
lookup then finds it ready. Where this Triton keeps the key elsewhere, nothing happens.
"""

from __future__ import annotations

import importlib
import logging
import threading
from typing import Callable

log = logging.getLogger("astream")

# Where Triton keeps its memoized cache-key function: runtime.cache in 3.6 and 3.9 (checked);
# older releases kept it in compiler.compiler.
_KEY_FUNCTIONS = (("triton.runtime.cache", "triton_key"), ("triton.compiler.compiler", "triton_key"))


def find_cache_key_function() -> Callable[[], str] | None:
    for module_name, attr in _KEY_FUNCTIONS:
        try:
            fn = getattr(importlib.import_module(module_name), attr, None)
        except ImportError:
            continue
        if callable(fn):
            return fn
    return None


def _compute(fn: Callable[[], str]) -> None:
    try:
        fn()
    except Exception as exc:      # the kernels' own lookup will meet (and report) it
        log.debug("Triton cache key warm-up failed: %r", exc)


def start_cache_key_warmup() -> threading.Thread | None:
    """Compute Triton's cache key in a daemon thread; join it before the first kernel runs.
    None where Triton is missing or keeps no such key."""
    fn = find_cache_key_function()
    if fn is None:
        return None
    thread = threading.Thread(target=_compute, args=(fn,), name="astream-triton-key", daemon=True)
    thread.start()
    return thread
