"""Random weights in the shape a config.json describes, for benchmarks (load_format="dummy").

Speed does not depend on weight values, so a Qwen3-4B-shaped model can be timed
without its 8 GB checkpoint. The values are small normals, norms are ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from astream.models.config import ModelConfig
from astream.models.tensor_parallel import TPShard


@dataclass(slots=True)
class DummyCheckpoint:
    path: Path
    hf_config: dict
    seed: int = 0

    @classmethod
    def open(cls, folder: Path) -> "DummyCheckpoint":
        return cls(folder, json.loads((folder / "config.json").read_text()))

    def tensor_names(self) -> list[str]:
        return [name for name, _ in _shapes(ModelConfig.from_hf(self.hf_config))]

    def iter_tensors(self, dtype: torch.dtype, device: torch.device | str,
                     shard: TPShard | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """With `shard`, every rank draws the whole tensors (one random stream) and keeps its part."""
        for name, tensor in self._draw(dtype, device):
            yield name, tensor if shard is None else shard.take(name, tensor)

    def _draw(self, dtype: torch.dtype, device: torch.device | str
              ) -> Iterator[tuple[str, torch.Tensor]]:
        generator = torch.Generator(device=device)
        generator.manual_seed(self.seed)
        for name, shape in _shapes(ModelConfig.from_hf(self.hf_config)):
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                yield name, torch.ones(shape, dtype=dtype, device=device)
            else:
                tensor = torch.empty(shape, dtype=torch.float32, device=device)
                yield name, tensor.normal_(0.0, 0.02, generator=generator).to(dtype)


def _shapes(c: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = [("model.embed_tokens.weight", (c.vocab_size, c.hidden_size)),
              ("model.norm.weight", (c.hidden_size,))]
    if not c.tie_word_embeddings:
        shapes.append(("lm_head.weight", (c.vocab_size, c.hidden_size)))
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (c.hidden_size,)),
                   (p + "self_attn.q_proj.weight", (q, c.hidden_size)),
                   (p + "self_attn.k_proj.weight", (kv, c.hidden_size)),
                   (p + "self_attn.v_proj.weight", (kv, c.hidden_size)),
                   (p + "self_attn.o_proj.weight", (c.hidden_size, q)),
                   (p + "post_attention_layernorm.weight", (c.hidden_size,)),
                   (p + "mlp.gate_proj.weight", (c.intermediate_size, c.hidden_size)),
                   (p + "mlp.up_proj.weight", (c.intermediate_size, c.hidden_size)),
                   (p + "mlp.down_proj.weight", (c.hidden_size, c.intermediate_size))]
        if c.qkv_bias:
            shapes += [(p + f"self_attn.{x}_proj.bias", (n,)) for x, n in (("q", q), ("k", kv), ("v", kv))]
        if c.qk_norm:
            shapes += [(p + "self_attn.q_norm.weight", (c.head_dim,)),
                       (p + "self_attn.k_norm.weight", (c.head_dim,))]
    return shapes
