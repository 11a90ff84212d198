"""A Hugging Face folder's tokenizer built with `tokenizers` alone, where its tokenizer.json
holds the whole pipeline: importing transformers costs 2-9 s of a fresh process (on the
H100 machine most of a Qwen3-4B folder's load, docs/BENCHMARKS.md).

That is so for the generic fast classes and the byte-level BPE families (GPT-2, Qwen2),
unless the config asks transformers to rewrite the pipeline (add_bos_token / add_eos_token
rebuild the post-processor, add_prefix_space the pre-tokenizer). Any other folder returns
None and goes through transformers, as before.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from astream.models.text_tokenizer import CONFIG_FILE, TOKENIZER_FILE, TextTokenizer, TokenizerSpec

PIPELINE_IN_FILE = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend", "GPT2Tokenizer",
                              "GPT2TokenizerFast", "Qwen2Tokenizer", "Qwen2TokenizerFast"})
REWRITES_PIPELINE = ("add_bos_token", "add_eos_token", "add_prefix_space")
NAMED = ("bos_token", "eos_token", "unk_token", "pad_token")
TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_MAP_FILE = "special_tokens_map.json"


def load_folder_tokenizer(folder: Path) -> TextTokenizer | None:
    """The folder's tokenizer, or None where transformers has to build it."""
    config = _json(folder / CONFIG_FILE)
    if not (folder / TOKENIZER_FILE).is_file() or not isinstance(config, dict):
        return None
    if config.get("tokenizer_class") not in PIPELINE_IN_FILE or any(config.get(k) for k in REWRITES_PIPELINE):
        return None
    special = _json(folder / SPECIAL_MAP_FILE)
    special = special if isinstance(special, dict) else {}
    tokens = {name: _content(config.get(name, special.get(name))) for name in NAMED}
    template = _chat_template(folder, config)
    if template is False:
        return None
    spec = TokenizerSpec(**tokens, chat_template=template, clean_up_tokenization_spaces=bool(
        config.get("clean_up_tokenization_spaces", False)))
    return TextTokenizer(Tokenizer.from_file(str(folder / TOKENIZER_FILE)), spec)


def _json(path: Path) -> object:
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def _content(token: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _chat_template(folder: Path, config: dict) -> str | None | bool:
    """The template (chat_template.jinja first, as transformers reads it), None without one,
    False for named templates, which this loader does not choose between."""
    if (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    return False
