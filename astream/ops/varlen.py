"""VarlenMeta: the layout of one packed batch of variable-length sequences."""

from __future__ import annotations

from dataclasses import dataclass

import torch
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

    @classmethod
    def single(cls, n_q: int, n_k: int, device: torch.device) -> "VarlenMeta":
        """One sequence of n_q queries over n_k keys."""
        # Offsets written on the device from host ints: no copy from the host, no sync.
        cu = torch.zeros(2, 2, dtype=torch.int32, device=device)
        cu[0, 1], cu[1, 1] = n_q, n_k
        return cls(cu[0], cu[1], n_q, n_k, [0, n_q], [0, n_k])
