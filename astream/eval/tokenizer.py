"""The model's tokenizer, obtained in one place, and handed on to the engines of a run."""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from astream.models.loader import load_tokenizer as _load_tokenizer, resolve_model_path


def load_tokenizer(model: str | None, tokenizer: str | None = None):
    """The tokenizer an Engine on `model` (and engine option `tokenizer`) would use."""
    path = Path(tokenizer).expanduser() if tokenizer else resolve_model_path(model)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer path does not exist: {path}")
    return _load_tokenizer(path)


@contextmanager
def engine_tokenizer_option(model: str | None, tokenizer, engine_kwargs: dict) -> Iterator[dict]:
    """`engine_kwargs`, plus a `tokenizer` folder holding the loaded tokenizer when the model is a
    GGUF file: converting a GGUF tokenizer takes seconds, and each configuration's engine would
    convert it again."""
    if engine_kwargs.get("tokenizer") or resolve_model_path(model).suffix != ".gguf":
        yield engine_kwargs
        return
    with tempfile.TemporaryDirectory(prefix="astream-eval-tokenizer-") as folder:
        tokenizer.save_pretrained(folder)
        yield {**engine_kwargs, "tokenizer": folder}
