"""Batched sampling on the device: greedy, temperature, top-k, top-p, per-request seeds,
after the penalties and min_tokens masks of executor.penalties.

Sampling draws one exponential variate per vocabulary entry and takes
argmax(p / E): that picks token i with probability p_i, with no host sync and
no cumulative-sum search. A seeded request draws its variates from a generator
seeded by (seed, token index), so its tokens do not depend on what else shares
the batch, or on preemption and recompute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from astream.base.sampling import choice_seed
from astream.core.scheduler import ScheduledSeq
from astream.executor.inputs import to_device
from astream.executor.penalties import LogitsProcessing, build_processing, process_logits

_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class SamplingBatch:
    temperatures: torch.Tensor          # [S] float32, 0 for greedy rows
    top_k: torch.Tensor | None          # [S] int64, vocab size where disabled; None if no row uses it
    top_p: torch.Tensor | None          # [S] float32; None if no row uses it
    all_greedy: bool
    seeded_rows: list[tuple[int, int]]  # (row, generator seed) for rows with a request seed
    processing: LogitsProcessing | None = None   # penalties, min_tokens; None if no row uses them
    num_logprobs: int | None = None     # most alternatives a row asked for; None if none asked

    @property
    def plain(self) -> bool:
        """Nothing but temperature, top-k, top-p and seeds: what a graph may sample."""
        return self.processing is None and self.num_logprobs is None


def build_sampling_batch(items: list[ScheduledSeq], vocab_size: int, device: torch.device,
                         eos_ids: frozenset[int] = frozenset()) -> SamplingBatch:
    rows = [item.seq for item in items if item.sample]
    processing = build_processing(rows, vocab_size, device, eos_ids)
    asked = [seq.params.logprobs for seq in rows if seq.params.logprobs is not None]
    num_logprobs = min(max(asked), vocab_size) if asked else None
    if all(seq.params.greedy for seq in rows):        # the common case: nothing to send
        return SamplingBatch(torch.zeros(len(rows), dtype=torch.float32, device=device),
                             None, None, True, [], processing, num_logprobs)
    temps, top_k, top_p, seeded = [], [], [], []
    any_top_k = any_top_p = False
    for row, seq in enumerate(rows):
        params = seq.params
        # Validated top_k fits int64; beyond the vocabulary it is the same as no top-k.
        k = min(params.top_k, vocab_size) or vocab_size
        temps.append(0.0 if params.greedy else params.temperature)
        top_k.append(k)
        top_p.append(params.top_p)
        if not params.greedy:
            any_top_k = any_top_k or k < vocab_size
            any_top_p = any_top_p or params.top_p < 1.0
            if params.seed is not None:
                seeded.append((row, _mix(choice_seed(params.seed, seq.index), seq.num_output_tokens)))
    return SamplingBatch(
        temperatures=to_device(temps, torch.float32, device),
        top_k=to_device(top_k, torch.int64, device) if any_top_k else None,
        top_p=to_device(top_p, torch.float32, device) if any_top_p else None,
        all_greedy=False, seeded_rows=seeded, processing=processing, num_logprobs=num_logprobs)


def sample(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator,
           previous_ids: torch.Tensor | None = None) -> torch.Tensor:
    """logits [S, V] float32 -> token ids [S] int64. `previous_ids`: the previous step's
    sampled ids, where penalized rows' newest tokens are still only on the device."""
    if batch.processing is not None:
        logits = process_logits(logits, batch.processing, previous_ids)
    return choose(logits, batch.temperatures, batch.top_k, batch.top_p, batch.all_greedy,
                  batch.seeded_rows, generator)


def choose(logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor | None,
           top_p: torch.Tensor | None, all_greedy: bool, seeded_rows: list[tuple[int, int]],
           generator: torch.Generator) -> torch.Tensor:
    """Processed logits [S, V] -> token ids [S]: the argmax of greedy rows (temperature 0),
    a draw at its temperature, after top-k and top-p, for each other row. A row whose top_k
    is the vocabulary size, or whose top_p is 1, is not cut."""
    greedy_ids = logits.argmax(dim=-1)
    if all_greedy:
        return greedy_ids
    temps = temperatures
    scaled = logits / torch.where(temps > 0, temps, torch.ones_like(temps)).unsqueeze(1)
    if top_k is not None or top_p is not None:
        scaled = mask_top_k_top_p(scaled, top_k, top_p)
    probs = torch.softmax(scaled, dim=-1)
    noise = _exponential_noise(probs, seeded_rows, generator)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(temps > 0, sampled, greedy_ids)


def mask_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                     top_p: torch.Tensor | None) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        drop |= ranks >= top_k.unsqueeze(1)
    if top_p is not None:
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # The top token always survives; a row at top_p 1 keeps its whole tail, which the
        # rounding of the cumulative sum could otherwise reach.
        drop |= (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _exponential_noise(probs: torch.Tensor, seeded_rows: list[tuple[int, int]],
                       generator: torch.Generator) -> torch.Tensor:
    noise = torch.empty_like(probs).exponential_(generator=generator)
    for row, seed in seeded_rows:
        row_gen = torch.Generator(device=probs.device)
        row_gen.manual_seed(seed)
        noise[row].exponential_(generator=row_gen)
    return noise


def _mix(seed: int, index: int) -> int:
    """A well-spread 63-bit generator seed for token `index` of a request seeded `seed`."""
    z = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1
