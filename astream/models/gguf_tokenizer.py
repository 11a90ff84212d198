"""The tokenizer of a GGUF file, as a `TextTokenizer`.

From the cache when it holds this file's (`tokenizer_cache`); else built from the header the
caller already parsed: a byte-level BPE vocabulary with `tokenizers` directly (`gguf_bpe`),
any other kind through transformers' GGUF conversion; then cached. A cached load never
imports transformers.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from pathlib import Path

from astream.models.gguf_bpe import bos_eos_processor, build_byte_level_bpe, can_build
from astream.models.gguf_layout import GGUFHeader, check_gguf_path, read_header
from astream.models.text_tokenizer import TextTokenizer, TokenizerSpec
from astream.models.tokenizer_cache import load_cached_tokenizer, store_cached_tokenizer

logger = logging.getLogger(__name__)

_BPE_RECIPE = "astream byte-level BPE 1"     # bump when gguf_bpe builds something different


def load_gguf_tokenizer(path: str | os.PathLike, header: GGUFHeader | None = None) -> TextTokenizer:
    """The tokenizer stored in `path`; `header` is the file's, when the caller has read it."""
    path = check_gguf_path(path)
    header = read_header(path) if header is None else header
    recipe = _recipe(header)
    cached = load_cached_tokenizer(path, header, recipe)
    if cached is not None:
        return cached
    tok = build_gguf_tokenizer(path, header)
    store_cached_tokenizer(path, header, recipe, tok)
    return tok


def build_gguf_tokenizer(path: str, header: GGUFHeader) -> TextTokenizer:
    """The file's tokenizer, built afresh (no cache)."""
    if can_build(header.fields):
        return TextTokenizer(*build_byte_level_bpe(header, path))
    return _via_transformers(Path(path), header)


def _recipe(header: GGUFHeader) -> str:
    if can_build(header.fields):
        return _BPE_RECIPE
    try:                                     # the version without importing it (about 2 s)
        return f"transformers {importlib.metadata.version('transformers')}, BOS/EOS as the file says"
    except importlib.metadata.PackageNotFoundError:
        return "transformers (not installed)"


def _via_transformers(path: Path, header: GGUFHeader) -> TextTokenizer:
    """transformers' conversion, for the vocabulary kinds `gguf_bpe` does not build; BOS and
    EOS are added as the file says, whatever the transformers version."""
    kind = header.fields.get("tokenizer.ggml.model")
    tok = _convert_tokenizer(path, kind)
    template = tok.chat_template if isinstance(tok.chat_template, str) else None
    add_bos, add_eos = _adds_bos_eos(header.fields, kind)
    spec = TokenizerSpec(
        bos_token=tok.bos_token, eos_token=tok.eos_token, unk_token=tok.unk_token,
        pad_token=tok.pad_token,
        chat_template=template or header.fields.get("tokenizer.chat_template") or None,
        add_bos_token=add_bos and tok.bos_token is not None,
        add_eos_token=add_eos and tok.eos_token is not None,
        clean_up_tokenization_spaces=bool(tok.clean_up_tokenization_spaces),
    )
    backend = tok.backend_tokenizer
    # transformers 5.18-5.22 drop the file's BOS from SentencePiece vocabularies (5.23 keeps it).
    if (spec.add_bos_token, spec.add_eos_token) != (bool(getattr(tok, "add_bos_token", False)),
                                                    bool(getattr(tok, "add_eos_token", False))):
        backend.post_processor = bos_eos_processor(spec, backend)
    return TextTokenizer(backend, spec)


def _adds_bos_eos(fields: dict, kind: str | None) -> tuple[bool, bool]:
    """Whether a prompt starts with BOS and ends with EOS: the file's flags, else llama.cpp's
    defaults (a SentencePiece "llama" vocabulary starts with BOS, others add neither)."""
    return (bool(fields.get("tokenizer.ggml.add_bos_token", kind == "llama")),
            bool(fields.get("tokenizer.ggml.add_eos_token", False)))


def _convert_tokenizer(path: Path, tokenizer_model: str | None):
    """transformers' tokenizer for the file.

    AutoTokenizer first builds the model's whole config to learn the tokenizer class (8-16 s
    for 49K-151K tokens). A byte-level BPE vocabulary converts to the same backend under the
    generic fast-tokenizer class, which skips that; any other kind keeps AutoTokenizer's class.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if tokenizer_model == "gpt2":
        try:
            return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
        except Exception as exc:           # another transformers version: take the long way
            logger.info("generic GGUF tokenizer conversion failed (%s); using AutoTokenizer", exc)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
