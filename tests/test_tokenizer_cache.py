"""The GGUF tokenizer cache: a hit behaves exactly like a fresh build; a damaged, stale or
disabled cache falls back to building."""

from __future__ import annotations

import os
import shutil

import pytest

from astream.models import gguf_tokenizer
from astream.models.gguf_layout import read_header
from astream.models.gguf_tokenizer import load_gguf_tokenizer
from astream.models.text_tokenizer import CONFIG_FILE, TOKENIZER_FILE
from astream.models.tokenizer_cache import cache_entry

TEXT = "Écris une phrase 🙂\n  def f(x):\treturn x * 2  # done"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def behaviour(tok) -> tuple:
    return (tok(TEXT)["input_ids"], tok.decode(tok(TEXT)["input_ids"]), tok.eos_token_id,
            tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False),
            len(tok), tok.backend_tokenizer.to_str())


def entry_of(path):
    path = str(path)
    return cache_entry(path, read_header(path), gguf_tokenizer._recipe(read_header(path)))


@pytest.fixture
def builds(monkeypatch) -> list[str]:
    """Records each fresh build of a tokenizer."""
    done, build = [], gguf_tokenizer.build_gguf_tokenizer

    def counted(path, header):
        done.append(path)
        return build(path, header)

    monkeypatch.setattr(gguf_tokenizer, "build_gguf_tokenizer", counted)
    return done


def test_a_cached_tokenizer_is_the_built_one(smollm2_path, tmp_path, monkeypatch, builds):
    monkeypatch.setenv("ASTREAM_CACHE_DIR", str(tmp_path))
    fresh = load_gguf_tokenizer(smollm2_path)
    entry = entry_of(smollm2_path)
    assert (entry / CONFIG_FILE).is_file() and (entry / TOKENIZER_FILE).is_file()
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]           # no staging left behind
    cached = load_gguf_tokenizer(smollm2_path, read_header(str(smollm2_path)))
    assert len(builds) == 1
    assert behaviour(cached) == behaviour(fresh)


@pytest.mark.parametrize("damage", ["garbage", "empty", "wrong_type"])
def test_a_damaged_entry_is_built_again(smollm2_path, tmp_path, monkeypatch, builds, damage):
    monkeypatch.setenv("ASTREAM_CACHE_DIR", str(tmp_path))
    reference = behaviour(load_gguf_tokenizer(smollm2_path))
    entry = entry_of(smollm2_path)
    for file in entry.iterdir():
        file.write_text({"garbage": "{not json", "empty": "", "wrong_type": '{"eos_token": 2}'}[damage])
    assert behaviour(load_gguf_tokenizer(smollm2_path)) == reference
    assert behaviour(load_gguf_tokenizer(smollm2_path)) == reference      # stored afresh
    assert len(builds) == 2


def test_an_edited_file_gets_a_new_entry(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("ASTREAM_CACHE_DIR", str(tmp_path / "cache"))
    copy = tmp_path / "model.gguf"
    shutil.copyfile(smollm2_path, copy)
    first, stat = entry_of(copy), copy.stat()
    with open(copy, "r+b") as fh:                   # same size and time, one letter of the template
        at = fh.read(4 << 20).index(b"You are a helpful")
        fh.seek(at)
        fh.write(b"y")
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    edited = entry_of(copy)
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert len({first, edited, entry_of(copy)}) == 3


def test_an_unwritable_cache_is_no_error(smollm2_path, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("ASTREAM_CACHE_DIR", str(blocker))
    assert load_gguf_tokenizer(smollm2_path)("Hello world")["input_ids"] == [19556, 905]


def test_an_empty_cache_dir_setting_disables_it(smollm2_path, monkeypatch):
    monkeypatch.setenv("ASTREAM_CACHE_DIR", "")
    assert entry_of(smollm2_path) is None
    assert load_gguf_tokenizer(smollm2_path)("Hello world")["input_ids"] == [19556, 905]
