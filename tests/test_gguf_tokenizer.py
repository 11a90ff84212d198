"""The engine's GGUF tokenizer (built with `tokenizers`, no transformers) against transformers'
AutoTokenizer on the same file: ids, text, special tokens and chat prompts, on the embedded
SmolLM2 file and on tiny byte-level BPE files written here (Qwen2 and Llama 3 splits)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import transformers
from jinja2 import TemplateError
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

from astream.models.gguf_layout import read_header
from astream.models.gguf_tokenizer import build_gguf_tokenizer, load_gguf_tokenizer
from astream.models.text_tokenizer import TextTokenizer

TEXTS = ["Hello, world!", "  leading spaces\tand tabs\n\nnewlines", "def f(x):\n    return x**2  # sq",
         "Ünïcödé café — “quotes” 日本語 中文 한국어 😀🚀👍🏽", "1234567890 3.14159 1e-9 0x1F",
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>x", "a" * 300,
         "    \n\n\n   ", "It's don't won't I'm we've they'll IT'S", "https://example.com/p?q=1&r=2#f",
         "\r\n\r\n x", "<tool_call>{\"a\": 1}</tool_call> <|spa ce|>", " ", "\u00a0\u2003 nbsp\u200b"]
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "  and 3+3? 😀  "}],
]
TOOLS = [{"type": "function", "function": {
    "name": "weather", "description": "Weather <now> & \"here\" — é",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
# A Qwen-like template using what Hugging Face templates rely on: tools through tojson, a
# namespace, loop variables, raise_exception, strftime_now, special tokens, and block tags
# whose whitespace trim_blocks / lstrip_blocks remove.
TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}Tiny.{% endif %}
{{- '\\n<tools>' }}
{%- for tool in tools %}{{ '\\n' + tool | tojson }}{% endfor %}
{{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role != 'system' %}
{{- '<|im_start|>system\\nTiny, ' + strftime_now('%Y')[:2] + '.<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if message.role not in ('system', 'user', 'assistant') %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- endif %}
    {%- if not (loop.first and message.role == 'system' and tools) %}
        {%- set ns.turns = ns.turns + 1 %}
<|im_start|>{{ message.role }}
{{ message.content | trim }}{% if loop.last and ns.turns > 3 %}{{ eos_token }}{% endif %}<|im_end|>
    {% endif %}
{%- endfor %}
{% if add_generation_prompt %}
    <|im_start|>assistant
{% endif %}"""


def _tiny_vocab(smollm2_path: Path) -> tuple[list[str], list[str]]:
    """The 256 byte symbols, then the first SmolLM2 merges that build on what is there."""
    merges_all = read_header(str(smollm2_path)).fields["tokenizer.ggml.merges"].values.decode()
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    have, merges = set(tokens), []
    for merge in merges_all:
        left, right = merge.split(" ")
        if left in have and right in have and left + right not in have:
            tokens.append(left + right)
            have.add(left + right)
            merges.append(merge)
            if len(tokens) == 1200:
                break
    return tokens, merges


def write_tiny_bpe(path: Path, smollm2_path: Path, pre: str, add_bos: bool) -> Path:
    """A one-tensor qwen2 GGUF with a byte-level BPE tokenizer: control and user-defined tokens,
    and a control token spelled outside the byte alphabet (which stays an ordinary token)."""
    tokens, merges = _tiny_vocab(smollm2_path)
    specials = {"<|endoftext|>": 3, "<|im_start|>": 3, "<|im_end|>": 3, "<tool_call>": 4,
                "</tool_call>": 4, "<|spa ce|>": 3}
    w = gguf.GGUFWriter(str(path), "qwen2")
    for add, value in ((w.add_block_count, 1), (w.add_context_length, 256),
                       (w.add_embedding_length, 32), (w.add_feed_forward_length, 64),
                       (w.add_head_count, 4), (w.add_head_count_kv, 2)):
        add(value)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens + list(specials))
    w.add_token_types([1] * len(tokens) + list(specials.values()))
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens))
    w.add_eos_token_id(len(tokens) + 2)
    w.add_pad_token_id(len(tokens))
    w.add_add_bos_token(add_bos)
    w.add_chat_template(TEMPLATE)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens) + len(specials), 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module", params=["smollm2", "qwen2", "llama-bpe"])
def pair(request, smollm2_path, smollm2_reference, tmp_path_factory):
    """(engine tokenizer built afresh, transformers' AutoTokenizer) for one file."""
    if request.param == "smollm2":
        path, reference = smollm2_path, smollm2_reference
    else:
        path = write_tiny_bpe(tmp_path_factory.mktemp("bpe") / "tiny.gguf", smollm2_path,
                              request.param, add_bos=request.param == "llama-bpe")
        reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    header = read_header(str(path))
    misread = misread_specials(reference, header.fields)
    if misread:
        pytest.skip(f"transformers {transformers.__version__} reads {misread} against the file's "
                    "metadata (5.23 reads them right): no reference to compare with")
    return build_gguf_tokenizer(str(path), header), reference


def misread_specials(reference, fields: dict) -> str | None:
    """What transformers' tokenizer of a byte-level BPE file gets wrong of its special tokens."""
    eos, bos = fields.get("tokenizer.ggml.eos_token_id"), fields.get("tokenizer.ggml.bos_token_id")
    if eos is not None and reference.eos_token_id != eos:
        return "its EOS token"
    starts_with_bos = bos is not None and reference.encode("a")[:1] == [bos]
    if starts_with_bos != bool(fields.get("tokenizer.ggml.add_bos_token", False)):
        return "whether a prompt starts with BOS"
    return None


def test_the_backend_is_transformers_one(pair):
    engine, reference = pair
    assert isinstance(engine, TextTokenizer)
    theirs = reference.backend_tokenizer.to_str()
    assert json.loads(engine.backend_tokenizer.to_str()) == json.loads(theirs)


def test_ids_and_text_match_autotokenizer(pair):
    engine, reference = pair
    for text in TEXTS:
        ids = reference(text)["input_ids"]
        assert engine(text)["input_ids"] == ids, text
        assert engine(text).input_ids == engine.encode(text) == reference.encode(text)
        assert (engine(text, return_offsets_mapping=True)["offset_mapping"]
                == reference(text, return_offsets_mapping=True)["offset_mapping"])
        plain = reference.encode(text, add_special_tokens=False)
        assert engine.encode(text, add_special_tokens=False) == plain
        assert engine.decode(ids) == reference.decode(ids)
        assert engine.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
        assert engine.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
        assert (engine.convert_ids_to_tokens(ids, skip_special_tokens=True)
                == reference.convert_ids_to_tokens(ids, skip_special_tokens=True))
    assert engine(TEXTS, add_special_tokens=False) == dict(reference(TEXTS, add_special_tokens=False))
    batch = dict(reference(TEXTS, return_offsets_mapping=True))
    assert engine(TEXTS, return_offsets_mapping=True) == batch


def test_special_tokens_and_vocabulary_match(pair):
    engine, reference = pair
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token", "bos_token_id", "eos_token_id",
                 "pad_token_id", "unk_token_id", "all_special_ids",
                 "special_tokens_map", "chat_template", "clean_up_tokenization_spaces", "vocab_size"):
        assert getattr(engine, attr) == getattr(reference, attr), attr
    assert len(engine) == len(reference) and engine.get_vocab() == reference.get_vocab()
    assert engine.convert_tokens_to_ids(["<|im_end|>", "Ġt", "no such token"]) == \
        reference.convert_tokens_to_ids(["<|im_end|>", "Ġt", "no such token"])


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_prompts_are_byte_identical(pair, generation_prompt, tools):
    engine, reference = pair
    options = dict(tools=tools, add_generation_prompt=generation_prompt)
    for chat in CHATS:
        mine = engine.apply_chat_template(chat, tokenize=False, **options)
        assert mine == reference.apply_chat_template(chat, tokenize=False, **options)
        assert (engine.apply_chat_template(chat, **options)["input_ids"]
                == reference.apply_chat_template(chat, **options)["input_ids"])


def test_a_template_error_is_raised(pair):
    engine, reference = pair
    if "raise_exception" not in engine.chat_template:
        pytest.skip("SmolLM2's template raises nothing")
    for tok in (engine, reference):
        with pytest.raises(TemplateError, match="unknown role robot"):
            tok.apply_chat_template([{"role": "robot", "content": "hi"}], tokenize=False)


def test_a_saved_tokenizer_loads_in_both(pair, tmp_path):
    engine, _ = pair
    engine.save_pretrained(tmp_path)
    ours, theirs = TextTokenizer.from_folder(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    for tok in (ours, theirs):
        assert [tok(t)["input_ids"] for t in TEXTS] == [engine(t)["input_ids"] for t in TEXTS]
        assert tok.eos_token_id == engine.eos_token_id and tok.all_special_ids == engine.all_special_ids
        assert (tok.apply_chat_template(CHATS[1], add_generation_prompt=True, tokenize=False)
                == engine.apply_chat_template(CHATS[1], add_generation_prompt=True, tokenize=False))


CHILD = """
import sys
from astream.models import gguf_tokenizer
first = gguf_tokenizer.load_gguf_tokenizer(sys.argv[1])         # built, then stored
def no_build(*args):
    raise AssertionError("the cached tokenizer was built again")
gguf_tokenizer.build_gguf_tokenizer = no_build
again = gguf_tokenizer.load_gguf_tokenizer(sys.argv[1])         # from the cache
assert "transformers" not in sys.modules, "transformers was imported"
assert again("Hello world")["input_ids"] == first("Hello world")["input_ids"] == [19556, 905]
assert again.chat_template == first.chat_template and again.eos_token_id == 2
"""


def test_building_and_a_cached_load_never_import_transformers(smollm2_path, tmp_path):
    path = os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "ASTREAM_CACHE_DIR": str(tmp_path), "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(smollm2_path)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def write_tiny_sentencepiece(path: Path) -> Path:
    """A one-tensor llama GGUF with a SentencePiece ("llama") vocabulary: scores, byte tokens."""
    pieces = ["\u2581", "a", "b", "c", "\u2581a", "ab", "\u2581ab", "bc", "h", "i", "\u2581h", "hi", "\u2581hi"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, 1), (w.add_context_length, 256),
                       (w.add_embedding_length, 32), (w.add_feed_forward_length, 64),
                       (w.add_head_count, 4), (w.add_head_count_kv, 2)):
        add(value)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_other_vocabulary_kinds_go_through_transformers_and_are_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("ASTREAM_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_sentencepiece(tmp_path / "spm.gguf")
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for _ in range(2):                                  # converted, then from the cache
        engine = load_gguf_tokenizer(path)
        for text in ["hi abc", " hi  a\nb", "é x", "<s>hi</s>"]:
            # The file's BOS starts every prompt (transformers 5.18-5.22 leave it out).
            ids = [1] + reference.encode(text, add_special_tokens=False)
            assert engine(text)["input_ids"] == ids
            assert engine.decode(ids) == reference.decode(ids)
            assert engine.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
        assert engine.all_special_ids == reference.all_special_ids
        assert engine.chat_template == reference.chat_template
