"""Sampling at the end of a decode step's static program (what its CUDA graphs capture):
greedy and temperature rows sample inside the step's graph; top-k, top-p, penalties,
min_tokens and logprobs in the sampling tail replayed after it; seeded rows on the host's
sampler; and every path gives the tokens the eager engine gives. On the CPU the static
programs run eagerly; on a GPU the same programs are captured (graph_sampling_check.py)."""

from __future__ import annotations

import pytest
import torch

from astream import LLM, SamplingParams
from astream.executor.cuda_graphs import DecodeGraphs
from astream.executor.graph_sampling import graph_mode
from astream.executor.sampler import SamplingBatch
from astream.executor.sampling_tail import Tail

KW = dict(device="cpu", dtype="float32", max_model_len=1024, max_num_seqs=4)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    with LLM(str(smollm2_path), **KW) as engine:
        yield engine


def eager_then_static(llm: LLM, prompts, params, seed: int | None = None) -> tuple[list, list, DecodeGraphs]:
    """The same requests on the eager engine, then from the static decode program; `seed`:
    the engine's generator starts from it both times."""
    eager, static, graphs = outputs_eager_then_static(llm, prompts, params, seed)
    return [o.token_ids for o in eager], [o.token_ids for o in static], graphs


def outputs_eager_then_static(llm: LLM, prompts, params, seed: int | None = None):
    runner = llm.core.runner
    runner.graphs = None
    if seed is not None:
        runner.generator.manual_seed(seed)
    eager = llm.generate(prompts, params)
    graphs = with_static_graphs(llm)
    if seed is not None:
        runner.generator.manual_seed(seed)
    try:
        static = llm.generate(prompts, params)
    finally:
        runner.graphs = None
    return eager, static, graphs


def with_static_graphs(llm: LLM, max_batch: int = 4) -> DecodeGraphs:
    runner, plan = llm.core.runner, llm.core.plan
    runner.graphs = DecodeGraphs(
        runner.decoder, runner.cache, runner.backends, runner.policy, runner.generator,
        max_batch=max_batch, max_blocks_per_seq=-(-plan.max_model_len // plan.block_size),
        max_context=plan.max_model_len)
    return runner.graphs


def batch(temperatures, top_k=None, top_p=None, seeded=()) -> SamplingBatch:
    temps = torch.tensor(temperatures, dtype=torch.float32)
    return SamplingBatch(temps, top_k, top_p, bool((temps == 0).all()), list(seeded))


def test_modes_follow_what_the_rows_ask():
    assert graph_mode(batch([0.0, 0.0])) == "greedy"
    assert graph_mode(batch([0.0, 0.7])) == "temperature"
    assert graph_mode(batch([0.7], top_p=torch.tensor([0.9]))) == Tail(False, True, True, False)
    assert graph_mode(batch([0.7], top_k=torch.tensor([5]))) == Tail(False, True, True, False)
    assert graph_mode(batch([0.7], seeded=[(0, 123)])) is None
    with_logprobs = batch([0.0, 0.0])
    with_logprobs.num_logprobs = 2
    assert graph_mode(with_logprobs) == Tail(False, False, False, True)


def test_penalties_min_tokens_and_logprobs_sample_in_the_tail(llm):
    """Rows that need logit processing or logprobs sample in the tail, and the static engine
    gives the eager engine's tokens and logprobs for them."""
    plain = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8,
                                                                       ignore_eos=True))]
    held = plain[1][2]                               # held back until min_tokens, then a stop id
    params = [SamplingParams(temperature=0, max_tokens=8, frequency_penalty=1.5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, min_tokens=6, stop_token_ids=[held],
                             logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3, presence_penalty=0.5,
                             logprobs=5, ignore_eos=True)]
    eager, static, graphs = outputs_eager_then_static(llm, PROMPTS, params)
    assert graphs.steps >= 5 and graphs.sampler.sampled_inside == graphs.steps
    got = [o.token_ids for o in static]
    assert got == [o.token_ids for o in eager]
    assert got[0] != plain[0] and got[2] != plain[2]             # the penalties changed the tokens
    assert got[1][:2] == plain[1][:2] and held not in got[1][:6]  # the ban did
    assert_same_logprobs(static, eager)


def assert_same_logprobs(got, want) -> None:
    for g, w in zip(got, want):
        assert (g.logprobs is None) == (w.logprobs is None)
        for a, b in zip(g.logprobs or (), w.logprobs or ()):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)


def test_sampled_rows_with_top_k_top_p_and_penalties_draw_as_the_eager_engine(llm):
    """A full batch (its captured size, nothing padded) draws the very noise the eager step
    draws from the engine's generator, so sampled rows give the eager engine's tokens too."""
    prompts = PROMPTS + ["Once upon a time"]
    params = [SamplingParams(temperature=0.9, top_k=20, max_tokens=10, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=1.2, top_p=0.8, presence_penalty=1.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, min_tokens=10, max_tokens=10, repetition_penalty=1.2),
              SamplingParams(temperature=1.0, frequency_penalty=0.5, max_tokens=10, ignore_eos=True)]
    eager, static, graphs = outputs_eager_then_static(llm, prompts, params, seed=1234)
    assert graphs.steps >= 9 and graphs.sampler.sampled_inside == graphs.steps
    assert [o.token_ids for o in static] == [o.token_ids for o in eager]
    assert_same_logprobs(static, eager)
    other, _, _ = eager_then_static(llm, prompts, params, seed=99)
    assert other != [o.token_ids for o in eager]              # the draws depend on the generator


def test_greedy_steps_sample_inside_and_match_the_eager_engine(llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    eager, static, graphs = eager_then_static(llm, PROMPTS, params)
    assert graphs.steps >= 11                        # every pure decode step ran the static program
    assert graphs.sampler.sampled_inside == graphs.steps
    assert static == eager
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_near_zero_temperature_samples_inside_and_picks_the_argmax(llm):
    # 1e-4 is above the greedy cut (1e-5): these rows take the temperature program.
    llm.core.runner.graphs = None
    greedy = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True))]
    graphs = with_static_graphs(llm)
    try:
        static = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(
            temperature=1e-4, max_tokens=10, ignore_eos=True))]
    finally:
        llm.core.runner.graphs = None
    assert graphs.steps >= 9 and graphs.sampler.sampled_inside == graphs.steps
    assert static == greedy


def test_greedy_and_temperature_rows_in_one_batch_sample_inside(llm):
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=1e-4, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)]
    greedy, _, _ = eager_then_static(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=10,
                                                                  ignore_eos=True))
    _, static, graphs = eager_then_static(llm, PROMPTS, params)
    assert graphs.steps >= 9 and graphs.sampler.sampled_inside == graphs.steps
    assert static == greedy


def test_seeded_rows_fall_back_to_the_host_sampler(llm):
    params = [SamplingParams(temperature=0.9, top_p=0.8, seed=7, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=11, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)]
    eager, static, graphs = eager_then_static(llm, PROMPTS, params)
    assert graphs.steps >= 9 and graphs.sampler.sampled_inside == 0
    assert static == eager                           # seeded rows: the same generator per row


def test_sampled_temperature_tokens_are_valid_and_vary(llm):
    params = SamplingParams(temperature=1.5, max_tokens=8, ignore_eos=True)
    _, static, graphs = eager_then_static(llm, [PROMPTS[0]] * 3, params)
    assert graphs.sampler.sampled_inside == graphs.steps >= 7
    vocab = llm.core.runner.decoder.config.vocab_size
    assert all(len(t) == 8 and all(0 <= i < vocab for i in t) for t in static)
    assert len({tuple(t) for t in static}) > 1       # three draws at temperature 1.5 differ
