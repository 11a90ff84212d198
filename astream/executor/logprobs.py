"""Logprobs of sampled tokens: computed on the device with the step, read on the host with
the sampled ids (the same awaited copy, see ModelRunner.program)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from astream.base.outputs import TokenLogprob


@dataclass(slots=True)
class StepLogprobs:
    """One step's logprobs; on the device, or host copies once the step's event completed."""

    chosen: torch.Tensor                # [S] float32: each sampled token's logprob
    top_values: torch.Tensor            # [S, K] float32, descending
    top_ids: torch.Tensor               # [S, K] int64

    def token(self, row: int, token_id: int, k: int) -> TokenLogprob:
        """Row `row`'s token with its k most likely alternatives (host copies only)."""
        top = tuple(zip(self.top_ids[row, :k].tolist(), self.top_values[row, :k].tolist()))
        return TokenLogprob(token_id, float(self.chosen[row]), top)


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> StepLogprobs:
    """The model's own distribution: log_softmax of the logits before any processing."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    top_values, top_ids = logprobs.topk(k, dim=-1)
    return StepLogprobs(chosen, top_values, top_ids)
