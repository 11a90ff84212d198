"""Prompts to token ids: strings, token id lists and chat messages."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Sequence as Seq, Union

from astream.base.validation import is_unicode

Prompt = Union[str, list[int], list[dict]]

# End-of-turn markers of the supported families; a chat model stops on any it has.
_END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>")


# How much a normalizer may shrink text (in UTF-8 bytes) before tokenization: Unicode
# normal forms and case folding at most 3x (three 3-byte Hangul jamo compose into one
# 3-byte syllable). A normalizer that can delete text (strip, replace by nothing) has no
# bound, and then prompts are not bounded before tokenization.
_SHRINK = {"NFC": 3, "NFD": 3, "NFKC": 3, "NFKD": 3, "Lowercase": 3, "Prepend": 1}
_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@dataclass(slots=True, frozen=True)
class PromptBound:
    """A lower bound on a prompt's tokens from its size alone: no token stands for more than
    `token_bytes` bytes, and normalization shrinks text at most `shrink` times."""

    token_bytes: int
    shrink: int                          # 0: the normalizer may delete text; no bound

    @classmethod
    def of(cls, tokenizer) -> "PromptBound":
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return cls(1, 0)
        # Only the two components are serialized: the whole tokenizer as JSON (its vocabulary
        # and merges) would take half a second for 151K tokens.
        byte_level = "ByteLevel" in _component_json(backend.pre_tokenizer)
        normalizer = json.loads(_component_json(backend.normalizer))
        vocab = backend.get_vocab(with_added_tokens=True)
        if byte_level:                           # each byte is one character
            longest = max(map(len, vocab), default=1)
        else:
            longest = max((_token_bytes(token) for token in vocab), default=1)
        return cls(max(longest, 1), _shrink(normalizer))

    def min_tokens(self, prompt: object) -> int:
        if isinstance(prompt, (list, tuple)) and not all(isinstance(m, dict) for m in prompt):
            return len(prompt)                   # token ids
        if self.shrink == 0:
            return 0
        if isinstance(prompt, str):
            size = _utf8_len(prompt)
        elif isinstance(prompt, (list, tuple)):
            size = sum(_utf8_len(m.get("content")) for m in prompt)
        else:
            return 0
        return size // (self.token_bytes * self.shrink)


def _component_json(component) -> str:
    """A tokenizers component's JSON (what pickling it stores); "null" for none."""
    return "null" if component is None else component.__getstate__().decode()


def _token_bytes(token: str) -> int:
    if _BYTE_FALLBACK.fullmatch(token):
        return 1
    return len(token.replace("\u2581", " ").encode("utf-8", "surrogatepass"))


def _shrink(normalizer: dict | None) -> int:
    if normalizer is None:
        return 1
    if normalizer.get("type") == "Sequence":
        factors = [_shrink(n) for n in normalizer.get("normalizers", [])]
        product = 1
        for factor in factors:
            if factor == 0:
                return 0
            product *= factor
        return product
    if normalizer.get("type") == "Replace" and normalizer.get("content"):
        return 1                                 # replaces with non-empty text (e.g. " " by "▁")
    return _SHRINK.get(normalizer.get("type"), 0)


def _utf8_len(text: object) -> int:
    return len(text.encode("utf-8", "surrogatepass")) if isinstance(text, str) else 0


def _check_unicode(text: str, what: str) -> None:
    if not is_unicode(text):
        raise ValueError(f"{what} is not valid unicode: it holds a lone surrogate")


def prompt_to_ids(tokenizer, prompt: Prompt, vocab_size: int) -> list[int]:
    """Tokenize one prompt; chat messages go through the model's chat template."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        _check_unicode(prompt, "prompt")
        return list(tokenizer(prompt)["input_ids"])
    if not isinstance(prompt, (list, tuple)) or len(prompt) == 0:
        raise ValueError("prompt must be a non-empty string, a non-empty list of token ids, "
                         f"or a non-empty list of chat messages; got {type(prompt).__name__}")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {vocab_size}): {bad[:5]}")
        return list(prompt)
    if all(isinstance(m, dict) for m in prompt):
        return chat_to_ids(tokenizer, prompt)
    raise ValueError("a list prompt must hold only token ids (int) or only chat messages (dict)")


def chat_to_ids(tokenizer, messages: Seq[dict]) -> list[int]:
    for i, message in enumerate(messages):
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise ValueError(f"chat message {i} needs string 'role' and 'content' fields")
        _check_unicode(message["role"], f"chat message {i}'s role")
        _check_unicode(message["content"], f"chat message {i}'s content")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; pass a plain string prompt instead")
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ValueError("chat messages rendered to an empty prompt")
    return ids


def stop_token_ids(tokenizer, config_eos: Seq[int]) -> tuple[int, ...]:
    """Token ids that end generation unless a request sets ignore_eos."""
    ids = set(config_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:                      # four lookups, not a copy of the vocabulary
        found = [backend.token_to_id(marker) for marker in _END_OF_TURN]
    else:
        vocab = tokenizer.get_vocab()
        found = [vocab.get(marker) for marker in _END_OF_TURN]
    ids.update(i for i in found if i is not None)
    return tuple(sorted(ids))
