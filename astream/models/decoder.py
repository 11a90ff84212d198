"""One decoder for the Llama / Qwen2 / Qwen3 family, as plain functions of explicit inputs.

A layer is split in two around attention so the caller decides how attention runs
(paged KV on the device, or KV streamed through a ring buffer from the host) and
may interleave other work between layers. Nothing here holds per-batch state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from astream.models.config import ModelConfig
from astream.models.layers import RotaryTable, rms_norm, swiglu

# attend(layer_index, q [T,H,D], k [T,KVH,D], v [T,KVH,D]) -> out [T,H,D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor                   # [(H + 2*KVH) * D, hidden], q rows then k then v
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor               # [2 * intermediate, hidden], gate rows then up
    down: torch.Tensor


@dataclass(slots=True)
class DecoderWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor               # the embedding itself when tied


@dataclass(slots=True)
class Decoder:
    config: ModelConfig
    weights: DecoderWeights
    rope: RotaryTable
    mlp_chunk_tokens: int = 8192        # bounds the MLP's activation memory on long prefills

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.weights.embed.device

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weights.embed)

    def attention_inputs(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Norm, QKV projection, optional q/k norm and RoPE: returns q, k, v."""
        cfg, w = self.config, self.weights.layers[layer]
        x = rms_norm(hidden, w.input_norm, cfg.rms_norm_eps)
        qkv = F.linear(x, w.qkv, w.qkv_bias)
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        if w.q_norm is not None:
            q = rms_norm(q, w.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, w.k_norm, cfg.rms_norm_eps)
        return self.rope.apply(q, positions), self.rope.apply(k, positions), v

    def finish_layer(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, MLP, residual."""
        cfg, w = self.config, self.weights.layers[layer]
        hidden = hidden + F.linear(attn_out.reshape(hidden.shape[0], -1), w.o_proj)
        x = rms_norm(hidden, w.post_norm, cfg.rms_norm_eps)
        if x.shape[0] <= self.mlp_chunk_tokens:
            return hidden + swiglu(x, w.gate_up, w.down)
        # Long prefills: the [T, 2*intermediate] activation dominates peak memory.
        for start in range(0, x.shape[0], self.mlp_chunk_tokens):
            end = start + self.mlp_chunk_tokens
            hidden[start:end] += swiglu(x[start:end], w.gate_up, w.down)
        return hidden

    def layer(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor,
              attend: AttendFn) -> torch.Tensor:
        q, k, v = self.attention_inputs(layer, hidden, positions)
        return self.finish_layer(layer, hidden, attend(layer, q, k, v))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden]."""
        hidden = self.embed(input_ids)
        for layer in range(self.config.num_layers):
            hidden = self.layer(layer, hidden, positions, attend)
        return self.final_norm(hidden)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden, self.weights.norm, self.config.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits for the given (already normed) hidden rows."""
        return F.linear(hidden, self.weights.lm_head).float()
