"""What loading a model shows on stderr (astream/engine/load_progress.py)."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from astream.engine.load_progress import SHOW_PROGRESS_ENV, LoadProgress, wants_progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_shown_on_a_terminal_unless_turned_off(monkeypatch):
    monkeypatch.delenv(SHOW_PROGRESS_ENV, raising=False)
    assert wants_progress(None, Terminal())
    assert not wants_progress(None, io.StringIO())          # a pipe or a log file
    assert wants_progress(True, io.StringIO()) and not wants_progress(False, Terminal())
    monkeypatch.setenv(SHOW_PROGRESS_ENV, "0")
    assert not wants_progress(None, Terminal())
    assert wants_progress(True, Terminal())                 # an explicit setting wins


def test_own_line_without_tqdm(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    screen = Terminal()
    with caplog.at_level(logging.DEBUG, logger="astream"):
        load = LoadProgress.start("/no/such/dir/model.gguf", show=True, stream=screen)
        for done in range(1, 5):
            load.weights(done, 4)
        load.finish()
    text = screen.getvalue()
    assert "\rastream: loading /no/such/dir/model.gguf: weights 4/4 (100%), preparing the KV cache" in text
    assert text.endswith("\r\033[K" + "astream: loaded /no/such/dir/model.gguf in 0.0 s\n")
    assert [r.levelno for r in caplog.records] == [logging.DEBUG, logging.DEBUG]   # said on screen


def test_tqdm_bar_when_installed():
    pytest.importorskip("tqdm")
    screen = Terminal()
    load = LoadProgress.start(None, show=True, stream=screen)
    for done in range(1, 11):
        load.weights(done, 10)
    load.finish()
    assert "astream: loading SmolLM2-135M-Instruct (embedded):" in screen.getvalue()
    assert "/10 [" in screen.getvalue()            # tqdm's counter (redrawn at most 10 times a second)
    assert screen.getvalue().endswith("astream: loaded SmolLM2-135M-Instruct (embedded) in 0.0 s\n")


def test_not_shown_goes_to_the_log_only(caplog):
    screen = Terminal()
    with caplog.at_level(logging.INFO, logger="astream"):
        load = LoadProgress.start(None, show=False, stream=screen)
        load.weights(1, 1)
        load.finish()
    assert screen.getvalue() == ""
    assert [r.getMessage() for r in caplog.records] == [
        "loading SmolLM2-135M-Instruct (embedded)", "loaded SmolLM2-135M-Instruct (embedded) in 0.0 s"]


def test_llm_shows_progress_when_asked(capfd):
    from astream import LLM

    with LLM(device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=256, show_progress=True):
        pass
    err = capfd.readouterr().err
    assert "astream: loaded SmolLM2-135M-Instruct (embedded) in" in err
    assert "\r" not in err                                   # no terminal: just the final line
