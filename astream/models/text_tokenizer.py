"""The engine's tokenizer: a `tokenizers.Tokenizer` and what a transformers tokenizer keeps
beside it (named special tokens, BOS/EOS flags, the chat template).

It answers the part of transformers' tokenizer interface that astream uses (calling it,
encode, decode, ids and tokens, the vocabulary, special tokens, apply_chat_template,
backend_tokenizer, save_pretrained) the same way, without importing transformers (about
2 s). It is saved as tokenizer.json plus tokenizer_config.json, a folder transformers'
AutoTokenizer loads too.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable

from tokenizers import Tokenizer

from astream.models.chat_template import render_chat

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"


@dataclass(slots=True)
class TokenizerSpec:
    """What a tokenizer knows beside its `tokenizers` pipeline (keys as in tokenizer_config.json)."""

    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None
    chat_template: str | None = None
    add_bos_token: bool = False
    add_eos_token: bool = False
    clean_up_tokenization_spaces: bool = False

    def named_tokens(self) -> list[str]:
        """The named special tokens, in transformers' order, each once."""
        named = (self.bos_token, self.eos_token, self.unk_token, self.pad_token)
        return list(dict.fromkeys(t for t in named if t is not None))

    def special_tokens_map(self) -> dict[str, str]:
        named = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                 "unk_token": self.unk_token, "pad_token": self.pad_token}
        return {k: v for k, v in named.items() if v is not None}

    @classmethod
    def from_config(cls, config: dict) -> "TokenizerSpec":
        """The known keys of a tokenizer_config.json; a value of the wrong type is an error."""
        spec = cls(**{f.name: config[f.name] for f in fields(cls) if f.name in config})
        for f in fields(cls):
            value, kind = getattr(spec, f.name), bool if f.type == "bool" else str
            if not (isinstance(value, kind) or (kind is str and value is None)):
                raise ValueError(f"{CONFIG_FILE}: {f.name} is {value!r}, not a {kind.__name__}")
        return spec


class Encoded(dict):
    """What calling the tokenizer returns: input_ids and attention_mask, as keys or attributes."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass(slots=True)
class TextTokenizer:
    backend_tokenizer: Tokenizer = field(repr=False)   # its repr spells out the whole vocabulary
    spec: TokenizerSpec

    # ---- special tokens --------------------------------------------------------------------

    bos_token = property(lambda self: self.spec.bos_token)
    eos_token = property(lambda self: self.spec.eos_token)
    unk_token = property(lambda self: self.spec.unk_token)
    pad_token = property(lambda self: self.spec.pad_token)
    bos_token_id = property(lambda self: self._id(self.spec.bos_token))
    eos_token_id = property(lambda self: self._id(self.spec.eos_token))
    unk_token_id = property(lambda self: self._id(self.spec.unk_token))
    pad_token_id = property(lambda self: self._id(self.spec.pad_token))
    add_bos_token = property(lambda self: self.spec.add_bos_token)
    add_eos_token = property(lambda self: self.spec.add_eos_token)
    clean_up_tokenization_spaces = property(lambda self: self.spec.clean_up_tokenization_spaces)
    is_fast = True

    @property
    def chat_template(self) -> str | None:
        return self.spec.chat_template

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        self.spec.chat_template = template

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return self.spec.special_tokens_map()

    @property
    def all_special_ids(self) -> list[int]:
        return [self._id(t) for t in self.spec.named_tokens()]

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    # ---- vocabulary --------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            found = self.backend_tokenizer.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | Iterable[int],
                              skip_special_tokens: bool = False) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    # ---- text <-> ids ------------------------------------------------------------------------

    def __call__(self, text: str | list[str], add_special_tokens: bool = True,
                 return_offsets_mapping: bool = False) -> Encoded:
        batch = [text] if isinstance(text, str) else list(text)
        encodings = self.backend_tokenizer.encode_batch(batch, add_special_tokens=add_special_tokens)
        columns = {"input_ids": [e.ids for e in encodings],
                   "attention_mask": [e.attention_mask for e in encodings]}
        if return_offsets_mapping:
            columns["offset_mapping"] = [e.offsets for e in encodings]
        return Encoded({k: v[0] if isinstance(text, str) else v for k, v in columns.items()})

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: int | Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else [int(i) for i in ids]
        text = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        if self.spec.clean_up_tokenization_spaces and not self._is_bpe():
            text = _clean_up_spaces(text)
        return text

    def _is_bpe(self) -> bool:
        # transformers never applies the space clean-up to BPE text: it would remove real spaces.
        return type(self.backend_tokenizer.model).__name__ == "BPE"

    # ---- chat --------------------------------------------------------------------------------

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            documents: list[dict] | None = None, *, add_generation_prompt: bool = False,
                            tokenize: bool = True, **variables: Any) -> str | Encoded:
        """The chat prompt; with tokenize (the default, as in transformers) its encoding."""
        if not self.spec.chat_template:
            raise ValueError("this tokenizer has no chat template")
        text = render_chat(self.spec.chat_template, list(conversation), tools=tools,
                           documents=documents, add_generation_prompt=add_generation_prompt,
                           **{**self.spec.special_tokens_map(), **variables})
        return self(text, add_special_tokens=False) if tokenize else text

    # ---- files -------------------------------------------------------------------------------

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        """Write tokenizer.json and tokenizer_config.json (which AutoTokenizer reads too)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend_tokenizer.save(str(folder / TOKENIZER_FILE))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **asdict(self.spec)}
        (folder / CONFIG_FILE).write_text(json.dumps(config, ensure_ascii=False, indent=1))

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> "TextTokenizer":
        """A tokenizer `save_pretrained` wrote."""
        folder = Path(folder)
        config = json.loads((folder / CONFIG_FILE).read_text())
        if not isinstance(config, dict):
            raise ValueError(f"{CONFIG_FILE} does not hold a JSON object")
        spec = TokenizerSpec.from_config(config)
        return cls(Tokenizer.from_file(str(folder / TOKENIZER_FILE)), spec)


def _clean_up_spaces(text: str) -> str:
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                          (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                          (" 're", "'re")):
        text = text.replace(before, after)
    return text
