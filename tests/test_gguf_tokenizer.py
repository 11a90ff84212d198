"""The GGUF tokenizer conversion the engine uses (the generic fast class for byte-level
BPE files) against AutoTokenizer's, which reads the whole file again to learn the class:
the same ids, text, special tokens and chat prompt."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from astream.models.gguf_loader import _convert_tokenizer

TEXTS = ["Hello, world!", "  leading spaces\tand tabs\n\nnewlines", "def f(x):\n    return x**2  # sq",
         "Ünïcödé café — “quotes” 日本語 中文 한국어 😀🚀👍🏽", "1234567890 3.14159 1e-9 0x1F",
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>x", "a" * 300,
         "    \n\n\n   ", "It's don't won't I'm we've they'll", "https://example.com/p?q=1&r=2#f"]


@pytest.fixture(scope="module")
def both(smollm2_path):
    engine = _convert_tokenizer(smollm2_path, "gpt2")
    auto = AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)
    return engine, auto


def test_ids_and_text_match_autotokenizer(both):
    engine, auto = both
    for text in TEXTS:
        ids = auto(text)["input_ids"]
        assert engine(text)["input_ids"] == ids, text
        assert engine.decode(ids) == auto.decode(ids)
        assert engine.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)


def test_special_tokens_and_chat_prompt_match(both):
    engine, auto = both
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token", "all_special_tokens",
                 "chat_template", "clean_up_tokenization_spaces"):
        assert getattr(engine, attr) == getattr(auto, attr), attr
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert (engine.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
