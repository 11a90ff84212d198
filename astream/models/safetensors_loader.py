"""Stream tensors out of a Hugging Face folder: one safetensors file or many with an index."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

from astream.models.tensor_parallel import TPShard, pad_rows


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({folder / name for name in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {folder}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"safetensors index names missing files: {missing}")
    return files


@dataclass(slots=True)
class SafetensorsCheckpoint:
    path: Path
    hf_config: dict
    files: list[Path]

    @classmethod
    def open(cls, folder: Path) -> "SafetensorsCheckpoint":
        try:
            config = json.loads((folder / "config.json").read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{folder / 'config.json'} is not valid JSON: {exc}") from exc
        return cls(folder, config, checkpoint_files(folder))

    def tensor_names(self) -> list[str]:
        names: list[str] = []
        for file in self.files:
            with _open(file) as handle:
                names += handle.keys()
        return names

    def iter_tensors(self, dtype: torch.dtype, device: torch.device | str,
                     shard: TPShard | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """With `shard`, each tensor's rank slice only is read from the file."""
        return _iter_files(self.files, dtype, torch.device(device), shard)


def _iter_files(files: list[Path], dtype: torch.dtype, device: torch.device,
                shard: TPShard | None) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with _open(file) as handle:
            for name in handle.keys():
                try:
                    tensor = _read(handle, name, shard)
                except (SafetensorError, RuntimeError) as exc:
                    raise ValueError(f"{file} is truncated or corrupt (tensor {name}): {exc}") from exc
                yield name, tensor.to(device=device, dtype=dtype)


def _read(handle, name: str, shard: TPShard | None) -> torch.Tensor:
    where = None if shard is None else shard.slice_of(name)
    if where is None:
        return handle.get_tensor(name)
    part = handle.get_slice(name)
    index = (slice(None),) * where.dim + (slice(where.start, where.stop),)
    return pad_rows(part[index], where)


def _open(file: Path):
    _check_extent(file)
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise ValueError(f"{file} is truncated or corrupt: {exc}") from exc


def _check_extent(file: Path) -> None:
    """A truncated file must fail here with a message, not later inside a memory map."""
    size = file.stat().st_size
    with file.open("rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise ValueError(f"{file} is truncated or corrupt: {size} bytes, no safetensors header")
        header_len = int.from_bytes(raw, "little")
        if header_len > size - 8:
            raise ValueError(f"{file} is truncated or corrupt: header of {header_len} bytes "
                             f"does not fit in {size} bytes")
        try:
            header = json.loads(fh.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{file} is truncated or corrupt: bad header ({exc})") from exc
    data_end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + data_end > size:
        raise ValueError(f"{file} is truncated or corrupt: tensors need {8 + header_len + data_end} "
                         f"bytes, the file has {size}")
