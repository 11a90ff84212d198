"""The GGUF tokenizer cache: a hit behaves exactly like a fresh conversion; a damaged or
disabled cache falls back to converting."""

from __future__ import annotations

import time

import pytest

from astream.models.gguf_loader import load_gguf_tokenizer
from astream.models.tokenizer_cache import _entry

TEXT = "Écris une phrase 🙂\n  def f(x):\treturn x * 2  # done"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def behaviour(tok) -> tuple:
    return (tok(TEXT)["input_ids"], tok.decode(tok(TEXT)["input_ids"]), tok.eos_token_id,
            tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False),
            len(tok), tok.backend_tokenizer.to_str())


def test_a_cached_tokenizer_is_the_converted_one(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("ASTREAM_CACHE_DIR", str(tmp_path))
    start = time.perf_counter()
    fresh = load_gguf_tokenizer(smollm2_path)
    converting = time.perf_counter() - start
    assert (_entry(str(smollm2_path)) / "tokenizer_config.json").is_file()
    start = time.perf_counter()
    cached = load_gguf_tokenizer(smollm2_path)
    assert time.perf_counter() - start < converting
    assert behaviour(cached) == behaviour(fresh)


@pytest.mark.parametrize("damage", ["garbage", "empty"])
def test_a_damaged_entry_is_converted_again(smollm2_path, tmp_path, monkeypatch, damage):
    monkeypatch.setenv("ASTREAM_CACHE_DIR", str(tmp_path))
    reference = behaviour(load_gguf_tokenizer(smollm2_path))
    entry = _entry(str(smollm2_path))
    for file in entry.iterdir():
        file.write_text("{not json" if damage == "garbage" else "")
    assert behaviour(load_gguf_tokenizer(smollm2_path)) == reference
    assert behaviour(load_gguf_tokenizer(smollm2_path)) == reference      # stored afresh


def test_an_empty_cache_dir_setting_disables_it(smollm2_path, monkeypatch):
    monkeypatch.setenv("ASTREAM_CACHE_DIR", "")
    assert _entry(str(smollm2_path)) is None
    assert load_gguf_tokenizer(smollm2_path)("Hello world")["input_ids"] == [19556, 905]
