"""A byte-level BPE tokenizer built from a GGUF header with the `tokenizers` library.

This is the vocabulary kind tokenizer.ggml.model calls "gpt2" (SmolLM2, Qwen, Llama 3).
What it builds is what transformers' GGUF conversion builds (tests/test_gguf_tokenizer.py
compares the two), without importing transformers: the vocabulary and merges as the file
stores them, the split pattern its tokenizer.ggml.pre names, its control tokens as special
added tokens and its user-defined ones as plain added tokens.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from astream.models.gguf_layout import ArrayValue, GGUFHeader
from astream.models.text_tokenizer import TokenizerSpec

BYTE_LEVEL_MODEL = "gpt2"

_CONTROL, _USER_DEFINED = 3, 4          # llama.cpp's tokenizer.ggml.token_type values


def _split_pattern(digit_run: str) -> str:
    # The pattern Llama 3 and Qwen2 publish in their tokenizer.json; they differ only in
    # how many digits one piece may hold.
    return (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + digit_run
            + r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


_LLAMA3_SPLIT = _split_pattern("{1,3}")
_QWEN2_SPLIT = _split_pattern("")
_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Names whose files keep GPT-2's own split, the one built into the ByteLevel pre-tokenizer
# (None: an older file that names none).
_GPT2_SPLIT = frozenset({None, "default", "gpt-2", "smollm", "starcoder"})


def can_build(fields: dict) -> bool:
    """Whether this module builds the file's tokenizer (others go through transformers)."""
    pre = fields.get("tokenizer.ggml.pre")
    return (fields.get("tokenizer.ggml.model") == BYTE_LEVEL_MODEL
            and (pre in _SPLITS or pre in _GPT2_SPLIT)
            and _strings(fields, "tokenizer.ggml.tokens") is not None
            and _strings(fields, "tokenizer.ggml.merges") is not None)


def build_byte_level_bpe(header: GGUFHeader, path: str) -> tuple[Tokenizer, TokenizerSpec]:
    """The tokenizer a byte-level BPE GGUF describes, and what a transformers tokenizer
    would know beside it (special tokens, BOS/EOS flags, chat template)."""
    fields = header.fields
    tokens = _strings(fields, "tokenizer.ggml.tokens").decode()
    alphabet = frozenset(pre_tokenizers.ByteLevel.alphabet())
    vocab = dict(zip(_byte_level_spellings(tokens, alphabet), range(len(tokens))))
    merges = [tuple(m.split(" ", 1)) for m in _strings(fields, "tokenizer.ggml.merges").decode()]
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(fields.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    spec = _spec(fields, tokens, path)
    _add_tokens(tok, tokens, _token_types(fields, len(tokens)), alphabet, vocab, spec)
    tok.post_processor = bos_eos_processor(spec, tok)
    return tok, spec


def _strings(fields: dict, key: str):
    value = fields.get(key)
    if isinstance(value, ArrayValue) and value.values is not None and value.item_type == 8:
        return value.values
    return None


def _byte_level_spellings(tokens: list[str], alphabet: frozenset[str]) -> list[str]:
    """Vocabulary keys: a token written with characters outside the byte alphabet (an added
    token stored as plain text) is spelled the way the pre-tokenizer spells its bytes."""
    if set("".join(tokens)) <= alphabet:
        return tokens
    spell = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return [t if set(t) <= alphabet else "".join(p for p, _ in spell.pre_tokenize_str(t))
            for t in tokens]


def _pre_tokenizer(pre: str | None):
    if pre in _GPT2_SPLIT:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _token_types(fields: dict, count: int) -> list[int]:
    value = fields.get("tokenizer.ggml.token_type")
    if isinstance(value, ArrayValue) and value.values is not None and value.item_type != 8:
        return value.values[:count].tolist()
    return []


def _spec(fields: dict, tokens: list[str], path: str) -> TokenizerSpec:
    def named(key: str) -> str | None:
        token_id = fields.get(f"tokenizer.ggml.{key}")
        if token_id is None:
            return None
        if not 0 <= token_id < len(tokens):
            raise ValueError(f"GGUF file {path} names token {token_id} as tokenizer.ggml.{key}, "
                             f"but its vocabulary has {len(tokens)} tokens")
        return tokens[token_id]

    return TokenizerSpec(
        bos_token=named("bos_token_id"), eos_token=named("eos_token_id"),
        unk_token=named("unknown_token_id"), pad_token=named("padding_token_id"),
        chat_template=fields.get("tokenizer.chat_template") or None,
        add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(fields.get("tokenizer.ggml.add_eos_token", False)),
    )


def _add_tokens(tok: Tokenizer, tokens: list[str], types: list[int], alphabet: frozenset[str],
                vocab: dict[str, int], spec: TokenizerSpec) -> None:
    """Control tokens stay whole as special tokens, user-defined ones as plain added tokens.

    A control token written outside the byte alphabet is a mislabel of the converter (every
    real token of this vocabulary is spelled in it), and is left alone, as transformers does.
    """
    control = [t for t, kind in zip(tokens, types) if kind == _CONTROL and set(t) <= alphabet]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, kind in zip(tokens, types) if kind == _USER_DEFINED and t in vocab]
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    added = set(control) | set(user)
    named = [t for t in spec.named_tokens() if t not in added]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in named])


def bos_eos_processor(spec: TokenizerSpec, tok: Tokenizer) -> processors.TemplateProcessing:
    """The post-processor that adds BOS / EOS to an encoding when the tokenizer asks for it."""
    bos = spec.bos_token if spec.add_bos_token else None
    eos = spec.eos_token if spec.add_eos_token else None

    def template(piece: str) -> str:
        return " ".join(filter(None, (f"{bos}:{piece[-1]}" if bos else "", piece,
                                      f"{eos}:{piece[-1]}" if eos else "")))

    special = [(t, tok.token_to_id(t)) for t in dict.fromkeys(filter(None, (bos, eos)))]
    return processors.TemplateProcessing(single=template("$A:0"),
                                         pair=f"{template('$A:0')} {template('$B:1')}",
                                         special_tokens=special)
