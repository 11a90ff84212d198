"""A Hugging Face folder's tokenizer built with `tokenizers` alone, where its tokenizer.json
holds the whole pipeline: importing transformers costs 2-9 s of a fresh process (on the
H100 machine most of a Qwen3-4B folder's load, docs/benchmarks-history.md).

That is so for the generic fast classes and the byte-level BPE families (GPT-2, Qwen2),
unless transformers would change what the file says:
- add_bos_token / add_eos_token rebuild the post-processor, add_prefix_space the
  pre-tokenizer, split_special_tokens encodes special tokens as plain text;
- a family class fills special tokens the config leaves out with its own defaults;
- a config saved without added_tokens_decoder (before transformers 4.34) lets
  special_tokens_map.json override it;
- several chat templates (additional_chat_templates/) are chosen between by the caller.
Any such folder returns None and goes through transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from astream.models.text_tokenizer import CONFIG_FILE, TOKENIZER_FILE, TextTokenizer, TokenizerSpec

GENERIC_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})
FAMILY_CLASSES = frozenset({"GPT2Tokenizer", "GPT2TokenizerFast", "Qwen2Tokenizer",
                            "Qwen2TokenizerFast"})
REWRITES_PIPELINE = ("add_bos_token", "add_eos_token", "add_prefix_space", "split_special_tokens")
NAMED = ("bos_token", "eos_token", "unk_token", "pad_token")
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATES_FOLDER = "additional_chat_templates"
SPECIAL_MAP_FILE = "special_tokens_map.json"


def load_folder_tokenizer(folder: Path) -> TextTokenizer | None:
    """The folder's tokenizer, or None where transformers has to build it."""
    config = _json(folder / CONFIG_FILE)
    if not (folder / TOKENIZER_FILE).is_file() or not isinstance(config, dict):
        return None
    if not _pipeline_as_written(folder, config):
        return None
    special = _json(folder / SPECIAL_MAP_FILE)
    special = special if isinstance(special, dict) else {}
    if special and "added_tokens_decoder" not in config:
        return None
    if config["tokenizer_class"] in FAMILY_CLASSES and any(
            name not in config and name not in special for name in NAMED):
        return None
    tokens = {name: _content(config.get(name, special.get(name))) for name in NAMED}
    template = _chat_template(folder, config)
    if template is False:
        return None
    spec = TokenizerSpec(**tokens, chat_template=template, clean_up_tokenization_spaces=bool(
        config.get("clean_up_tokenization_spaces", False)))
    return TextTokenizer(Tokenizer.from_file(str(folder / TOKENIZER_FILE)), spec)


def _pipeline_as_written(folder: Path, config: dict) -> bool:
    """Whether transformers would use tokenizer.json as it is, with one chat template."""
    known = config.get("tokenizer_class") in GENERIC_CLASSES | FAMILY_CLASSES
    return (known and not any(config.get(key) for key in REWRITES_PIPELINE)
            and not (folder / TEMPLATES_FOLDER).is_dir())


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
