"""A disk cache of the tokenizers built from GGUF files.

An entry is the folder `TextTokenizer.save_pretrained` writes (tokenizer.json and
tokenizer_config.json), read back without transformers. The key covers the file (path,
size, modification time and a hash of its metadata bytes, where the tokenizer lives), the
`tokenizers` version and how the tokenizer was built (`recipe`), so an edited file or an
upgraded builder builds afresh. The folder is $ASTREAM_CACHE_DIR, else
$XDG_CACHE_HOME/astream, else ~/.cache/astream; set ASTREAM_CACHE_DIR to "" to disable it.
A cache that cannot be read or written is skipped, never an error.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

import tokenizers

from astream.models.gguf_layout import GGUFHeader
from astream.models.text_tokenizer import CONFIG_FILE, TextTokenizer

logger = logging.getLogger(__name__)


def cache_root() -> Path | None:
    configured = os.environ.get("ASTREAM_CACHE_DIR")
    if configured is not None:
        return Path(configured).expanduser() if configured else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "astream"


def cache_entry(path: str, header: GGUFHeader, recipe: str) -> Path | None:
    """The folder holding this file's tokenizer, or None when the cache is disabled."""
    root = cache_root()
    if root is None:
        return None
    stat = os.stat(path)
    key = (f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}|{header.metadata_digest}|"
           f"tokenizers {tokenizers.__version__}|{recipe}")
    return root / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:32]


def load_cached_tokenizer(path: str, header: GGUFHeader, recipe: str) -> TextTokenizer | None:
    """The tokenizer saved for this exact file, or None."""
    entry = None
    try:
        entry = cache_entry(path, header, recipe)
        if entry is None or not (entry / CONFIG_FILE).is_file():
            return None
        return TextTokenizer.from_folder(entry)
    except Exception as exc:                 # a damaged entry: drop it, build again
        logger.warning("ignoring the cached tokenizer of %s: %s", path, exc)
        if entry is not None:
            shutil.rmtree(entry, ignore_errors=True)
        return None


def store_cached_tokenizer(path: str, header: GGUFHeader, recipe: str,
                           tokenizer: TextTokenizer) -> None:
    """Save a built tokenizer for later loads (atomically: a folder renamed into place)."""
    try:
        entry = cache_entry(path, header, recipe)
        if entry is None:
            return
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=entry.parent))
        try:
            tokenizer.save_pretrained(staging)
            try:
                os.replace(staging, entry)
            except OSError:                  # another process won the race: keep theirs
                pass
        finally:                             # nothing left after the rename; else the pieces
            shutil.rmtree(staging, ignore_errors=True)
    except Exception as exc:
        logger.warning("could not cache the tokenizer of %s: %s", path, exc)
