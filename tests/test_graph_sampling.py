"""Sampling at the end of a decode step's static program (what its CUDA graph captures):
greedy and temperature rows sample inside it, top-k / top-p / seeded rows fall back to the
host's sampler, and every path gives the tokens the eager engine gives. On the CPU the
static program runs eagerly; on a GPU the same program is captured (gpu_correctness.py)."""

from __future__ import annotations

import pytest
import torch

from astream import LLM, SamplingParams
from astream.executor.cuda_graphs import DecodeGraphs
from astream.executor.graph_sampling import graph_mode
from astream.executor.sampler import SamplingBatch

KW = dict(device="cpu", dtype="float32", max_model_len=1024, max_num_seqs=4)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    with LLM(str(smollm2_path), **KW) as engine:
        yield engine


def eager_then_static(llm: LLM, prompts, params) -> tuple[list, list, DecodeGraphs]:
    """The same requests on the eager engine, then from the static decode program."""
    llm.core.runner.graphs = None
    eager = [o.token_ids for o in llm.generate(prompts, params)]
    graphs = with_static_graphs(llm)
    try:
        static = [o.token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.core.runner.graphs = None
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
    assert graph_mode(batch([0.7], top_p=torch.tensor([0.9]))) is None
    assert graph_mode(batch([0.7], top_k=torch.tensor([5]))) is None
    assert graph_mode(batch([0.7], seeded=[(0, 123)])) is None


def test_penalties_min_tokens_and_logprobs_sample_on_the_host(llm):
    """Rows that need logit processing or logprobs leave the graph, and the static engine
    gives the eager engine's tokens for them."""
    with_logprobs = batch([0.0, 0.0])
    with_logprobs.num_logprobs = 2
    assert graph_mode(with_logprobs) is None
    params = [SamplingParams(temperature=0, max_tokens=8, frequency_penalty=1.5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, min_tokens=4, logprobs=2),
              SamplingParams(temperature=0.8, max_tokens=8, repetition_penalty=1.3, ignore_eos=True)]
    eager, static, graphs = eager_then_static(llm, PROMPTS, params)
    assert static[:2] == eager[:2] and all(len(ids) == 8 for ids in static)
    assert graphs.sampler.sampled_inside == 0


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


def test_top_p_and_seeded_rows_fall_back_to_the_host_sampler(llm):
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
