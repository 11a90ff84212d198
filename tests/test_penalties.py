"""Penalties and the min_tokens mask on the device against a plain per-token reference."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from astream.base.sampling import SamplingParams
from astream.core.sequence import Sequence
from astream.executor.penalties import build_processing, process_logits

VOCAB = 50
EOS = frozenset({2})


def reference(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    """vLLM's repetition penalty over prompt and output, then OpenAI's frequency and presence
    penalties over the output, one token at a time."""
    out = logits.clone()
    rep = params.repetition_penalty
    for token in set(prompt) | set(output):
        out[token] = out[token] / rep if out[token] > 0 else out[token] * rep
    for token, count in Counter(output).items():
        out[token] -= params.frequency_penalty * count + params.presence_penalty
    return out


def seq(prompt: list[int], output: list[int], params: SamplingParams, pending_row: int = -1) -> Sequence:
    s = Sequence("r", prompt, params, 0, output_token_ids=list(output))
    if pending_row >= 0:
        s.num_pending, s.pending_row = 1, pending_row
    return s


CASES = {
    "presence": SamplingParams(presence_penalty=1.5),
    "frequency": SamplingParams(frequency_penalty=-0.7),
    "repetition": SamplingParams(repetition_penalty=1.8),
    "combined": SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=0.5),
}


@pytest.mark.parametrize("name", list(CASES))
def test_penalties_match_the_reference(name):
    params = CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    logits = torch.randn(4, VOCAB, generator=gen) * 3
    prompt = [3, 4, 4, 9, 17]
    outputs = [[5, 5, 5, 9, 11], [], [4, 30, 30], [7]]
    previous_ids = torch.tensor([12, 30, 7, 40])   # the last step's sampled ids, on the device
    pending = {2: 1, 3: 0}                         # row -> its newest token's row there
    rows = [seq(prompt, outputs[0], params), seq(prompt, outputs[1], SamplingParams()),
            seq(prompt, outputs[2], params, pending[2]), seq(prompt, outputs[3], params, pending[3])]
    processed = process_logits(logits, build_processing(rows, VOCAB, torch.device("cpu"), EOS), previous_ids)
    assert torch.equal(processed[1], logits[1])    # a row without penalties is untouched
    for row in (0, 2, 3):
        output = outputs[row] + ([int(previous_ids[pending[row]])] if row in pending else [])
        torch.testing.assert_close(processed[row], reference(logits[row], prompt, output, params))


def test_nothing_to_do_builds_nothing():
    rows = [seq([1, 2], [3], SamplingParams(temperature=0.5, top_k=3)), seq([1], [], SamplingParams(min_tokens=1, max_tokens=2), -1)]
    rows[1].output_token_ids = [4]                  # min_tokens reached
    assert build_processing(rows, VOCAB, torch.device("cpu"), EOS) is None


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    stop = SamplingParams(min_tokens=3, stop_token_ids=(7, 8, 10**6))   # an id past the vocabulary is ignored
    rows = [seq([1], [5], stop),
            seq([1], [5, 6], SamplingParams(min_tokens=3, stop_token_ids=(7,), ignore_eos=True)),
            seq([1], [5, 6, 9], stop),                     # reached: nothing masked
            seq([1], [5], stop, pending_row=0)]            # 1 known + 1 pending < 3
    logits = torch.zeros(4, VOCAB)
    processed = process_logits(logits, build_processing(rows, VOCAB, torch.device("cpu"), EOS),
                               torch.tensor([6]))
    masked = {row: set(torch.nonzero(processed[row].isinf()).flatten().tolist()) for row in range(4)}
    assert masked == {0: {2, 7, 8}, 1: {7}, 2: set(), 3: {2, 7, 8}}
