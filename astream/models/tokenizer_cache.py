"""A disk cache of tokenizers converted from GGUF files.

The key covers the file (path, size, modification time and a hash of its first MiB,
where the tokenizer metadata lives) and the converting libraries' versions, so an edited
file or an upgraded converter builds afresh. The folder is $ASTREAM_CACHE_DIR, else
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

logger = logging.getLogger(__name__)

_HEADER_BYTES = 1 << 20
_MARKER = "tokenizer_config.json"


def cache_root() -> Path | None:
    configured = os.environ.get("ASTREAM_CACHE_DIR")
    if configured is not None:
        return Path(configured).expanduser() if configured else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "astream"


def _entry(path: str) -> Path | None:
    root = cache_root()
    if root is None:
        return None
    import tokenizers
    import transformers

    stat = os.stat(path)
    digest = hashlib.sha256()
    digest.update(f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}|"
                  f"{transformers.__version__}|{tokenizers.__version__}|".encode())
    with open(path, "rb") as fh:
        digest.update(fh.read(_HEADER_BYTES))
    return root / "tokenizers" / digest.hexdigest()[:32]


def load_cached_tokenizer(path: str):
    """The tokenizer saved for this exact file, or None."""
    entry = None
    try:
        entry = _entry(path)
        if entry is None or not (entry / _MARKER).is_file():
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(entry))
    except Exception as exc:                 # a damaged entry: drop it, convert again
        logger.warning("ignoring the cached tokenizer of %s: %s", path, exc)
        if entry is not None:
            shutil.rmtree(entry, ignore_errors=True)
        return None


def store_cached_tokenizer(path: str, tokenizer) -> None:
    """Save a converted tokenizer for later loads (atomically: a folder renamed into place)."""
    try:
        entry = _entry(path)
        if entry is None:
            return
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=entry.parent))
        tokenizer.save_pretrained(str(staging))
        try:
            os.replace(staging, entry)
        except OSError:                      # another process won the race: keep theirs
            shutil.rmtree(staging, ignore_errors=True)
    except Exception as exc:
        logger.warning("could not cache the tokenizer of %s: %s", path, exc)
