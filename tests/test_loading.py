"""Loading a GGUF model: its header is parsed once, and the tokenizer comes before the weights."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from astream.models import gguf_layout, gguf_loader, gguf_tokenizer
from astream.models.loader import load_model, open_checkpoint


def test_a_load_parses_the_header_once_and_the_tokenizer_first(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("ASTREAM_CACHE_DIR", str(tmp_path))
    events = []

    def read_header(path):
        events.append("header")
        return gguf_layout.read_header(path)

    def load_gguf_tokenizer(path, header=None):
        events.append("tokenizer")
        return real_load(path, header)

    real_load = gguf_tokenizer.load_gguf_tokenizer
    for module in (gguf_loader, gguf_tokenizer):
        monkeypatch.setattr(module, "read_header", read_header)
    monkeypatch.setattr(gguf_tokenizer, "load_gguf_tokenizer", load_gguf_tokenizer)
    for _ in range(2):                                   # built, then from the cache
        events.clear()
        model = load_model(open_checkpoint(smollm2_path), torch.bfloat16, torch.device("cpu"),
                           progress=lambda done, total: events.append("weights"))
        assert events[:3] == ["header", "tokenizer", "weights"] and events.count("header") == 1
        assert model.tokenizer("Hello world")["input_ids"] == [19556, 905]


def test_a_missing_tokenizer_fails_before_any_weight(smollm2_path, tmp_path):
    def no_weights(*args):
        raise AssertionError("weights were loaded")

    checkpoint = SimpleNamespace(path=str(smollm2_path), header=None, hf_config={},
                                 tensor_names=no_weights, iter_tensors=no_weights)
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_model(checkpoint, torch.float32, torch.device("cpu"), tokenizer=str(tmp_path / "nope.gguf"))
