"""The sampling tail's static program (what its CUDA graphs capture) against the eager
sampler on random logits: the same tokens and logprobs for greedy rows with penalties,
min_tokens bans and pending tokens, padded rows ignored, tables cleared between steps; the
same draws for sampled rows with top-k and top-p when the batch fills its size."""

from __future__ import annotations

import torch

from astream.base.sampling import SamplingParams
from astream.core.sequence import Sequence
from astream.executor.logprobs import compute_logprobs
from astream.executor.penalties import build_processing
from astream.executor.sampler import SamplingBatch, sample
from astream.executor.sampling_tail import SamplingTables, Tail, tail_mode, tail_modes
from astream.kvcache.sizing import SAMPLING_TABLE_BYTES

VOCAB = 300
EOS = frozenset({2})
CPU = torch.device("cpu")


def seq(prompt: list[int], output: list[int], params: SamplingParams, pending_row: int = -1) -> Sequence:
    s = Sequence("r", prompt, params, 0, output_token_ids=list(output))
    if pending_row >= 0:
        s.num_pending, s.pending_row = 1, pending_row
    return s


def sampling_batch(rows: list[Sequence], temperatures: list[float], top_k=None, top_p=None,
                   logprobs: int | None = None) -> SamplingBatch:
    temps = torch.tensor(temperatures, dtype=torch.float32)
    return SamplingBatch(temps, top_k, top_p, bool((temps == 0).all()), [],
                         build_processing(rows, VOCAB, CPU, EOS), logprobs)


def run_tail(tables: SamplingTables, batch: SamplingBatch, logits: torch.Tensor, size: int,
             previous_ids: torch.Tensor | None, generator: torch.Generator) -> torch.Tensor:
    n = batch.temperatures.shape[0]
    tail = tail_mode(batch)
    assert tail in tail_modes(True)
    temperatures = torch.ones(size)
    temperatures[:n] = batch.temperatures
    tables.logits[:size] = logits
    tables.fill(batch, n, size, tail, previous_ids)
    return tables.program(size, tail, temperatures, generator)[:n]


def check_logprobs(tables: SamplingTables, logits: torch.Tensor, ids: torch.Tensor, k: int) -> None:
    want, got = compute_logprobs(logits, ids, k), tables.logprobs(ids.shape[0])
    assert torch.equal(got.chosen, want.chosen)
    assert torch.equal(got.top_values[:, :k], want.top_values)
    assert torch.equal(got.top_ids[:, :k], want.top_ids)


def test_greedy_rows_with_penalties_bans_and_pending_tokens_match_the_eager_sampler():
    gen = torch.Generator().manual_seed(0)
    tables = SamplingTables.allocate(8, VOCAB, CPU)
    prompt = [3, 4, 4, 9, 17]
    previous_ids = torch.tensor([12, 30, 7, 40])     # the last step's ids, still on the device
    steps = [  # each with the token each processed row would take without its processing
        ([seq(prompt, [5, 5, 9], SamplingParams(frequency_penalty=2.0, temperature=0)),
          seq(prompt, [], SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7, 8])),
          seq(prompt, [4, 30], SamplingParams(repetition_penalty=1.8, presence_penalty=1.0, temperature=0), 1),
          seq(prompt, [11], SamplingParams(temperature=0))], {0: 5, 1: 7, 2: 30}),
        # The next step: other rows penalized, no ban; the last step's tables must not leak
        # (row 1 banned 7 then: now its argmax).
        ([seq(prompt, [6], SamplingParams(presence_penalty=2.0, temperature=0), 2),
          seq(prompt, [1, 2], SamplingParams(temperature=0))], {0: 7}),
    ]
    for step, (rows, hits) in enumerate(steps):
        logits = torch.randn(8, VOCAB, generator=gen)
        for row, token in [*hits.items(), *([(1, 7)] if step else [])]:
            logits[row, token] = logits[row].max() + 0.5
        batch = sampling_batch(rows, [0.0] * len(rows), logprobs=4)
        n = len(rows)
        got = run_tail(tables, batch, logits, 8, previous_ids, gen)   # padded to 8
        want = sample(logits[:n], batch, gen, previous_ids)
        assert torch.equal(got, want)
        assert all(int(got[row]) != token for row, token in hits.items())
        assert int(got[n - 1]) == int(logits[n - 1].argmax())        # an unprocessed row: its argmax
        check_logprobs(tables, logits[:n], got, 4)


def test_sampled_rows_with_top_k_and_top_p_draw_the_eager_sampler_noise():
    gen = torch.Generator().manual_seed(1)
    tables = SamplingTables.allocate(4, VOCAB, CPU)
    rows = [seq([1, 2], [40, 40], SamplingParams(temperature=0.8, top_k=5, frequency_penalty=1.0)),
            seq([1, 2], [], SamplingParams(temperature=1.3, top_p=0.7)),
            seq([1, 2], [3], SamplingParams(temperature=0, min_tokens=2)),
            seq([1, 2], [], SamplingParams(temperature=1.0))]
    batch = sampling_batch(rows, [0.8, 1.3, 0.0, 1.0], top_k=torch.tensor([5, VOCAB, VOCAB, VOCAB]),
                           top_p=torch.tensor([1.0, 0.7, 1.0, 1.0]), logprobs=0)
    assert tail_mode(batch) == Tail(True, True, True, True)
    draws = []
    for _ in range(20):
        logits = torch.randn(4, VOCAB, generator=gen)
        state = gen.get_state()
        got = run_tail(tables, batch, logits, 4, None, gen)
        gen.set_state(state)
        want = sample(logits, batch, gen)
        assert torch.equal(got, want)
        check_logprobs(tables, logits, got, 0)
        top5 = logits[0].topk(5).indices
        assert int(got[0]) in top5.tolist()                           # top-k held
        draws.append(got)
    assert len({tuple(d.tolist()) for d in draws}) > 1


def test_the_tables_are_what_the_memory_plan_counts_per_row_and_token():
    tables = SamplingTables.allocate(6, VOCAB, CPU)
    assert sum(t.nbytes for t in tables.vocab_tables) == 6 * VOCAB * SAMPLING_TABLE_BYTES
    # Every combination a step may need that the whole-step graphs do not sample.
    assert len(tail_modes(True)) == 10 and all(t.process or t.filter or t.logprobs
                                               for t in tail_modes(True))
    assert tail_modes(False) == [t for t in tail_modes(True) if not t.draw]
