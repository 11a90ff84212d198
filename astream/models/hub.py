"""Models named by Hugging Face hub id ("Qwen/Qwen2.5-0.5B-Instruct"): the local snapshot,
downloaded when online, taken from the local cache when offline (HF_HUB_OFFLINE=1).

The environment is read at each call (HF_HUB_OFFLINE, HF_HUB_CACHE), so an application
that sets it after importing astream is honoured.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# What a safetensors folder needs: config, weights, tokenizer files.
SNAPSHOT_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def looks_like_hub_id(text: str) -> bool:
    """'org/name' with no other slashes, not a local-looking path (./x, ~/x, /x, x.gguf)."""
    return bool(_HUB_ID.fullmatch(text)) and not text.endswith(".gguf")


def hub_snapshot(repo_id: str) -> Path:
    """The folder of `repo_id`'s latest snapshot; FileNotFoundError saying why there is none."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    cache = os.environ.get("HF_HUB_CACHE") or None
    try:
        folder = snapshot_download(repo_id, allow_patterns=SNAPSHOT_FILES, cache_dir=cache,
                                   local_files_only=offline)
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"model {repo_id!r} is neither a local path nor a model on the "
                                "Hugging Face hub (a private or gated one needs `hf auth login`)") from None
    except LocalEntryNotFoundError:
        where = cache or "the default Hugging Face cache"
        why = ("HF_HUB_OFFLINE is set, so nothing is downloaded; unset it, or download the model "
               "first" if offline else "and downloading it failed (no network?)")
        raise FileNotFoundError(f"model {repo_id!r} is not a local path and is not in {where}; "
                                f"{why}") from None
    return Path(folder)
