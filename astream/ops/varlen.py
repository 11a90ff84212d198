"""VarlenMeta: the layout of one packed batch of variable-length sequences."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(slots=True)
class VarlenMeta:
    """Sequence layout of one packed batch; built once per batch, shared by all layers.

    Causal attention with seqlen_q < seqlen_k is bottom-right aligned: query i of
    a sequence sees keys j <= i + (len_k - len_q).
    """

    cu_seqlens_q: Tensor  # [S+1] int32 on the device
    cu_seqlens_k: Tensor  # [S+1] int32 on the device
    max_seqlen_q: int
    max_seqlen_k: int
    host_cu_seqlens_q: list[int]  # same offsets on the host; never .tolist() device tensors
    host_cu_seqlens_k: list[int]
