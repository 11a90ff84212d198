"""A Hugging Face folder's tokenizer built from its tokenizer.json without transformers,
against transformers' AutoTokenizer on the same folder (ids, text, special tokens, chat
prompts), and the folders that must still go through transformers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from astream.models.folder_tokenizer import load_folder_tokenizer
from astream.models.loader import load_tokenizer
from astream.models.text_tokenizer import TextTokenizer
from tests.test_gguf_tokenizer import CHATS, TEXTS


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, smollm2_tokenizer):
    """SmolLM2's tokenizer in a folder as transformers writes one (chat_template.jinja,
    special tokens as it saves them), and transformers' tokenizer of that folder."""
    root = tmp_path_factory.mktemp("tok")
    smollm2_tokenizer.save_pretrained(root / "engine")
    AutoTokenizer.from_pretrained(root / "engine").save_pretrained(root / "hf")
    return root / "hf", AutoTokenizer.from_pretrained(root / "hf")


def test_folder_tokenizer_matches_autotokenizer(hf_folder):
    folder, want = hf_folder
    got = load_folder_tokenizer(folder)
    assert isinstance(got, TextTokenizer)
    for text in TEXTS:
        ids = want(text)["input_ids"]
        assert got(text)["input_ids"] == ids, text
        assert got.decode(ids) == want.decode(ids)
        assert got.decode(ids, skip_special_tokens=True) == want.decode(ids, skip_special_tokens=True)
    assert (got.bos_token_id, got.eos_token_id, got.pad_token_id) == (
        want.bos_token_id, want.eos_token_id, want.pad_token_id)
    for chat in CHATS:
        for generation in (True, False):
            assert got.apply_chat_template(chat, add_generation_prompt=generation, tokenize=False) == \
                want.apply_chat_template(chat, add_generation_prompt=generation, tokenize=False)


def test_special_tokens_written_as_added_token_dicts_are_read(hf_folder, tmp_path):
    folder, want = hf_folder
    for name in ("tokenizer.json", "chat_template.jinja"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["eos_token"] = {"content": config["eos_token"], "special": True, "lstrip": False}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_folder_tokenizer(tmp_path).eos_token_id == want.eos_token_id


def _altered_copy(folder, tmp_path, change: dict, drop: tuple[str, ...] = ()) -> None:
    (tmp_path / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    config = {**json.loads((folder / "tokenizer_config.json").read_text()), **change}
    for key in drop:
        config.pop(key, None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("change, drop", [
    ({"tokenizer_class": "LlamaTokenizerFast"}, ()),
    ({"add_bos_token": True}, ()), ({"add_prefix_space": True}, ()),
    ({"split_special_tokens": True}, ()),                       # special strings as plain text
    ({"chat_template": [{"name": "default", "template": "x"}]}, ()),
    ({"tokenizer_class": "Qwen2Tokenizer"}, ("unk_token",)),    # the class's default fills it
])
def test_folders_that_transformers_would_change_go_through_it(hf_folder, tmp_path, change, drop):
    _altered_copy(hf_folder[0], tmp_path, change, drop)
    assert load_folder_tokenizer(tmp_path) is None
    assert not isinstance(load_tokenizer(tmp_path), TextTokenizer)     # transformers' own


def test_several_chat_templates_or_an_old_special_tokens_map_go_through_transformers(hf_folder,
                                                                                    tmp_path):
    _altered_copy(hf_folder[0], tmp_path, {})
    assert isinstance(load_folder_tokenizer(tmp_path), TextTokenizer)
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS")
    assert load_folder_tokenizer(tmp_path) is None
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").unlink()
    (tmp_path / "additional_chat_templates").rmdir()
    _altered_copy(hf_folder[0], tmp_path, {}, drop=("added_tokens_decoder",))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    assert load_folder_tokenizer(tmp_path) is None                     # the map would win there


def test_loading_a_folder_tokenizer_never_imports_transformers(hf_folder):
    folder, _ = hf_folder
    code = ("import sys\nfrom pathlib import Path\nfrom astream.models.loader import load_tokenizer\n"
            f"tok = load_tokenizer(Path({str(folder)!r}))\n"
            "print(type(tok).__name__, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["TextTokenizer", "False"], out.stderr
