"""Assemble DecoderWeights from Hugging Face-named tensors, fusing QKV and gate/up."""

from __future__ import annotations

import re
from typing import Iterable

import torch

from astream.models.config import ModelConfig
from astream.models.decoder import DecoderWeights, LayerWeights

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LAYER_PARTS = {
    "input_layernorm.weight": "input_norm",
    "self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v",
    "self_attn.q_proj.bias": "q_bias", "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "self_attn.o_proj.weight": "o_proj",
    "post_attention_layernorm.weight": "post_norm",
    "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down",
}
_GLOBAL_PARTS = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm",
                 "lm_head.weight": "lm_head"}


def assemble_weights(config: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]]) -> DecoderWeights:
    """Consume (name, tensor) pairs already in the target dtype and device."""
    layers: list[dict[str, torch.Tensor]] = [{} for _ in range(config.num_layers)]
    globals_: dict[str, torch.Tensor] = {}
    built: list[LayerWeights | None] = [None] * config.num_layers
    for name, tensor in tensors:
        match = _LAYER.match(name)
        if match:
            index, part = int(match.group(1)), _LAYER_PARTS.get(match.group(2))
            if part is None or index >= config.num_layers:
                continue
            layers[index][part] = tensor
            if _layer_complete(config, layers[index]):
                built[index] = _fuse_layer(config, layers[index], index)
                layers[index] = {}
        elif name in _GLOBAL_PARTS:
            globals_[_GLOBAL_PARTS[name]] = tensor
    missing = [i for i, layer in enumerate(built) if layer is None]
    if missing:
        absent = sorted(set(_required(config)) - set(layers[missing[0]]))
        raise ValueError(f"checkpoint is missing weights of layer {missing[0]} "
                         f"({', '.join(absent)}); {len(missing)} layer(s) incomplete")
    return _finish(config, globals_, built)


def _required(config: ModelConfig) -> list[str]:
    parts = ["input_norm", "q", "k", "v", "o_proj", "post_norm", "gate", "up", "down"]
    if config.qkv_bias:
        parts += ["q_bias", "k_bias", "v_bias"]
    if config.qk_norm:
        parts += ["q_norm", "k_norm"]
    return parts


def _layer_complete(config: ModelConfig, parts: dict[str, torch.Tensor]) -> bool:
    return all(p in parts for p in _required(config))


def _fuse_layer(config: ModelConfig, p: dict[str, torch.Tensor], index: int) -> LayerWeights:
    expect_q = (config.num_heads * config.head_dim, config.hidden_size)
    if tuple(p["q"].shape) != expect_q:
        raise ValueError(f"layer {index} q_proj has shape {tuple(p['q'].shape)}, "
                         f"config implies {expect_q}")
    bias = torch.cat((p["q_bias"], p["k_bias"], p["v_bias"])) if config.qkv_bias else None
    return LayerWeights(
        input_norm=p["input_norm"],
        qkv=torch.cat((p["q"], p["k"], p["v"])),
        qkv_bias=bias,
        q_norm=p.get("q_norm"), k_norm=p.get("k_norm"),
        o_proj=p["o_proj"],
        post_norm=p["post_norm"],
        gate_up=torch.cat((p["gate"], p["up"])),
        down=p["down"],
    )


def _finish(config: ModelConfig, g: dict[str, torch.Tensor], layers: list) -> DecoderWeights:
    for part in ("embed", "norm"):
        if part not in g:
            raise ValueError(f"checkpoint is missing {part} weights")
    lm_head = g.get("lm_head")
    if lm_head is None:
        if not config.tie_word_embeddings:
            raise ValueError("checkpoint has no lm_head.weight and the config does not tie embeddings")
        lm_head = g["embed"]
    return DecoderWeights(embed=g["embed"], layers=layers, norm=g["norm"], lm_head=lm_head)
