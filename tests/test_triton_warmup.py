"""Triton's cache key computed in a background thread while a model loads (CUDA engines)."""

from __future__ import annotations

import importlib.util
import logging
import threading

import pytest

from astream.ops import triton_warmup


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_the_installed_triton_keeps_a_memoized_cache_key():
    fn = triton_warmup.find_cache_key_function()
    assert fn is not None, "this Triton keeps its cache key elsewhere: update _KEY_FUNCTIONS"
    assert hasattr(fn, "cache_info"), "the key must be memoized, or computing it early is useless"


def test_warmup_computes_the_key_once_in_its_own_thread(monkeypatch):
    calls = []
    monkeypatch.setattr(triton_warmup, "find_cache_key_function",
                        lambda: lambda: calls.append(threading.current_thread().name))
    thread = triton_warmup.start_cache_key_warmup()
    thread.join(timeout=10)
    assert calls == ["astream-triton-key"] and thread.daemon


def test_a_failing_key_is_logged_not_raised(monkeypatch, caplog):
    def broken() -> str:
        raise OSError("libtriton.so unreadable")
    monkeypatch.setattr(triton_warmup, "find_cache_key_function", lambda: broken)
    with caplog.at_level(logging.DEBUG, logger="astream"):
        triton_warmup.start_cache_key_warmup().join(timeout=10)
    assert "libtriton.so unreadable" in caplog.text


def test_no_triton_key_no_thread(monkeypatch):
    monkeypatch.setattr(triton_warmup, "find_cache_key_function", lambda: None)
    assert triton_warmup.start_cache_key_warmup() is None
