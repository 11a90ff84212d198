"""One decoder for the Llama / Qwen2 / Qwen3 family, as plain functions of explicit inputs.

The caller passes `attend`, so it decides how attention runs (paged KV on the device, or
KV streamed through a ring buffer from the host) and may interleave other work between
layers; `layer` runs one layer. Nothing here holds per-batch state.

Between sub-layers the residual stream travels as a `Residual`: the running sum and the
last sub-layer's output not yet added to it, so each add happens inside the next RMSNorm
(one fused kernel on CUDA, see ops.layer_kernels).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from astream.models.config import ModelConfig
from astream.models.layers import RotaryTable
from astream.models.tensor_parallel import TensorParallel
from astream.ops.layer_kernels import LayerKernels

# attend(layer_index, q [T,H,D], k [T,KVH,D], v [T,KVH,D]) -> out [T,H,D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# lookahead(layer_index, residual [T, hidden] entering that layer, positions [T]): called
# before the layer's attention, so a caller may start work the next layer will need.
LookaheadFn = Callable[[int, torch.Tensor, torch.Tensor], None]


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
class Residual:
    """The residual stream: `hidden` + `pending` (None: nothing pending), [T, hidden] each."""

    hidden: torch.Tensor
    pending: torch.Tensor | None = None


@dataclass(slots=True)
class Decoder:
    config: ModelConfig
    weights: DecoderWeights
    rope: RotaryTable
    kernels: LayerKernels = field(default_factory=LayerKernels)
    mlp_chunk_tokens: int = 8192        # bounds the MLP's activation memory on long prefills
    tp: TensorParallel | None = None    # this rank's shard; `config` is then the shard's shape

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.weights.embed.device

    @property
    def rank(self) -> int:
        """This process's tensor-parallel rank (0 without tensor parallelism)."""
        return 0 if self.tp is None else self.tp.rank

    def embed(self, input_ids: torch.Tensor) -> Residual:
        if self.tp is None:
            return Residual(F.embedding(input_ids, self.weights.embed))
        local = input_ids - self.tp.shard.vocab_start
        elsewhere = (local < 0) | (local >= self.weights.embed.shape[0])
        rows = F.embedding(local.masked_fill(elsewhere, 0), self.weights.embed)
        return Residual(self.tp.all_reduce(rows.masked_fill_(elsewhere[:, None], 0)))

    def layer(self, layer: int, stream: Residual, positions: torch.Tensor,
              attend: AttendFn, lookahead: LookaheadFn | None = None) -> Residual:
        cfg, w, ops = self.config, self.weights.layers[layer], self.kernels
        x, hidden = ops.add_rms_norm(stream.hidden, stream.pending, w.input_norm, cfg.rms_norm_eps)
        if lookahead is not None:
            lookahead(layer, hidden, positions)
        q, k, v = ops.qkv_rope(F.linear(x, w.qkv, w.qkv_bias), positions, self.rope.cos,
                               self.rope.sin, cfg.num_heads, cfg.num_kv_heads, w.q_norm,
                               w.k_norm, cfg.rms_norm_eps)
        attn_out = F.linear(attend(layer, q, k, v).reshape(hidden.shape[0], -1), w.o_proj)
        x, hidden = ops.add_rms_norm(hidden, self._reduce(attn_out), w.post_norm, cfg.rms_norm_eps)
        return Residual(hidden, self._reduce(self._mlp(w, x)))

    def early_query(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s query [T, H, D] computed from another layer's residual stream
        `hidden` [T, hidden] (its input norm, Q projection, Q norm and RoPE): a prediction
        of the query, made before the layers in between have run. It runs the layer's own
        kernels (the whole QKV projection and the fused norm and RoPE, K and V dropped):
        three launches instead of a dozen small ones, on a prefetch's critical path."""
        cfg, w, ops = self.config, self.weights.layers[layer], self.kernels
        x = ops.add_rms_norm(hidden, None, w.input_norm, cfg.rms_norm_eps)[0]
        return ops.qkv_rope(F.linear(x, w.qkv, w.qkv_bias), positions, self.rope.cos,
                            self.rope.sin, cfg.num_heads, cfg.num_kv_heads, w.q_norm, w.k_norm,
                            cfg.rms_norm_eps)[0]

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's partial sums, completed over the ranks."""
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def _mlp(self, w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.mlp_chunk_tokens:
            return F.linear(self.kernels.silu_mul(F.linear(x, w.gate_up)), w.down)
        # Long prefills: the [T, 2*intermediate] activation dominates peak memory.
        out = torch.empty_like(x)
        for start in range(0, x.shape[0], self.mlp_chunk_tokens):
            rows = slice(start, start + self.mlp_chunk_tokens)
            out[rows] = F.linear(self.kernels.silu_mul(F.linear(x[rows], w.gate_up)), w.down)
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: AttendFn,
                lookahead: LookaheadFn | None = None) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden]."""
        stream = self.embed(input_ids)
        for layer in range(self.config.num_layers):
            stream = self.layer(layer, stream, positions, attend, lookahead)
        return self.final_norm(stream)

    def final_norm(self, stream: Residual) -> torch.Tensor:
        return self.kernels.add_rms_norm(stream.hidden, stream.pending, self.weights.norm,
                                         self.config.rms_norm_eps)[0]

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits for the given (already normed) hidden rows, into `out` if given (the
        same one conversion to float32, written there); under tensor parallelism every rank
        takes part and every rank gets the whole vocabulary."""
        logits = F.linear(hidden, self.weights.lm_head)
        if self.tp is not None:
            return self.tp.gather_vocab(logits, self.config.vocab_size, out)
        if out is not None:
            return out.copy_(logits)
        return logits.float()
