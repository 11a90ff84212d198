"""Penalties, min_tokens, logprobs and n completions through the engine, and their validation."""

from __future__ import annotations

import dataclasses
from collections import Counter

import anyio
import pytest

from astream import Engine, SamplingParams
from astream.base.sampling import MAX_LOGPROBS

GREEDY = dict(temperature=0, ignore_eos=True)


def test_every_field_has_a_help_text_with_its_range():
    for f in dataclasses.fields(SamplingParams):
        assert f.metadata.get("help"), f.name


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("frequency_penalty", float("nan")),
    ("frequency_penalty", "1"), ("repetition_penalty", 0), ("repetition_penalty", 2.5),
    ("min_tokens", -1), ("min_tokens", 1.5), ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1),
    ("logprobs", True), ("n", 0), ("n", 17), ("n", 2.0)])
def test_out_of_range_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict({field: value})


def test_min_tokens_may_not_exceed_max_tokens():
    SamplingParams(min_tokens=8, max_tokens=8)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=9, max_tokens=8)


def test_presence_and_frequency_penalties_pick_the_best_penalized_token(smol_llm):
    """Greedy with penalties takes, at every position, the token whose logprob minus its
    penalty is highest: checked against the 20 alternatives each token reports."""
    presence, frequency = 0.8, 1.5
    plain = smol_llm.generate("1, 2, 3, 4,", SamplingParams(max_tokens=24, **GREEDY))[0]
    out = smol_llm.generate("1, 2, 3, 4,", SamplingParams(max_tokens=24, presence_penalty=presence,
                                                          frequency_penalty=frequency, logprobs=20,
                                                          **GREEDY))[0]
    assert out.token_ids != plain.token_ids
    assert max(Counter(out.token_ids).values()) < max(Counter(plain.token_ids).values())
    for i, token in enumerate(out.logprobs):
        counts = Counter(out.token_ids[:i])

        def score(token_id: int, logprob: float) -> float:
            n = counts[token_id]
            return logprob - frequency * n - (presence if n else 0.0)

        best = max(score(t, lp) for t, lp in token.top)
        assert score(token.token_id, token.logprob) >= best - 1e-4, f"position {i}"


def test_repetition_penalty_covers_the_prompt(smol_llm):
    prompt = "1, 2, 3, 4,"
    comma = smol_llm.tokenizer.encode(",", add_special_tokens=False)[0]
    plain = smol_llm.generate(prompt, SamplingParams(max_tokens=12, **GREEDY))[0]
    out = smol_llm.generate(prompt, SamplingParams(max_tokens=12, repetition_penalty=2.0, **GREEDY))[0]
    assert comma in plain.token_ids and comma not in out.token_ids


def test_min_tokens_holds_back_stop_ids_and_eos(smol_llm):
    prompt = "The quick brown fox"
    path = smol_llm.generate(prompt, SamplingParams(max_tokens=8, **GREEDY))[0].token_ids
    stop_id = path[2]
    early = smol_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_id]))[0]
    assert early.finish_reason == "stop" and len(early.token_ids) == 3
    held = smol_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, min_tokens=6,
                                                    stop_token_ids=[stop_id]))[0]
    assert len(held.token_ids) >= 6 and stop_id not in held.token_ids[:6]

    chat = [{"role": "user", "content": "What is the capital of France?"}]
    short = smol_llm.generate([chat], SamplingParams(temperature=0, max_tokens=64))[0]
    assert short.finish_reason == "stop"
    longer = smol_llm.generate([chat], SamplingParams(temperature=0, max_tokens=64,
                                                      min_tokens=len(short.token_ids) + 4))[0]
    assert len(longer.token_ids) >= len(short.token_ids) + 4


def test_logprobs_are_the_models_distribution(smol_llm):
    prompt = "The capital of France is"
    ids = smol_llm.tokenizer.encode(prompt)
    out = smol_llm.generate([ids], SamplingParams(max_tokens=6, logprobs=5, **GREEDY))[0]
    assert len(out.logprobs) == len(out.token_ids) == 6
    for token_id, token in zip(out.token_ids, out.logprobs):
        assert token.token_id == token_id and len(token.top) == 5
        values = [lp for _, lp in token.top]
        assert token.top[0] == (token_id, token.logprob)            # greedy: the top one
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert sum(2.718281828 ** v for v in values) <= 1 + 1e-5
    # Each decode step's logprob equals the same position's from a prefill of its own.
    for i in (1, 4):
        alone = smol_llm.generate([ids + out.token_ids[:i]],
                                  SamplingParams(max_tokens=1, logprobs=5, **GREEDY))[0].logprobs[0]
        assert alone.token_id == out.token_ids[i]
        assert alone.logprob == pytest.approx(out.logprobs[i].logprob, abs=1e-4)
        assert [t for t, _ in alone.top] == [t for t, _ in out.logprobs[i].top]

    sampled = smol_llm.generate([ids], SamplingParams(max_tokens=6, logprobs=0, temperature=1.5, seed=3))[0]
    assert all(t.top == () and t.logprob <= 0 for t in sampled.logprobs)
    assert smol_llm.generate([ids], SamplingParams(max_tokens=3, **GREEDY))[0].logprobs is None


def test_n_greedy_completions_are_identical_and_share_the_prompt(smol_llm):
    prompt = "Zebra quartz violin 17 marmalade: " * 6                  # in no other test's cache
    num_prompt = len(smol_llm.tokenizer.encode(prompt))
    before = smol_llm.stats()
    out = smol_llm.generate(prompt, SamplingParams(max_tokens=10, n=3, **GREEDY))[0]
    after = smol_llm.stats()
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(o.token_ids == out.token_ids and o.text == out.text and len(o.token_ids) == 10
               for o in out.outputs)
    assert [o.finish_reason for o in out.outputs] == ["length"] * 3
    # The prompt was computed once: the other two attached its full blocks.
    shared = (num_prompt - 1) // after["kv_block_size"]
    assert shared >= 3 and after["prefix_cache_hits"] - before["prefix_cache_hits"] == 2 * shared
    assert after["kv_blocks_free"] == after["kv_blocks_total"] and after["requests"] == 0


def test_n_seeded_completions_are_reproducible(smol_llm):
    params = SamplingParams(max_tokens=8, n=3, seed=11, temperature=1.0, ignore_eos=True)
    first = [o.token_ids for o in smol_llm.generate("Once upon a time", params)[0].outputs]
    again = [o.token_ids for o in smol_llm.generate("Once upon a time", params)[0].outputs]
    assert first == again and len({tuple(ids) for ids in first}) == 3
    alone = smol_llm.generate("Once upon a time", dataclasses.replace(params, n=1))[0]
    assert alone.token_ids == first[0]                            # choice 0 is the n=1 request


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
@pytest.mark.anyio
async def test_n_streams_interleave_and_abort_frees_every_block():
    async with Engine(device="cpu", dtype="float32", num_kv_blocks=128, max_model_len=1024) as engine:
        total = engine.stats()["kv_blocks_total"]
        prompt = "A long prompt that spans a few blocks of the cache. " * 4
        params = SamplingParams(max_tokens=6, n=3, temperature=0.7, seed=1, ignore_eos=True, logprobs=1)
        tokens = [tok async for tok in engine.stream(prompt, params)]
        assert sorted(Counter(t.choice for t in tokens).items()) == [(0, 6), (1, 6), (2, 6)]
        assert [t.finish_reason for t in tokens if t.finish_reason] == ["length"] * 3
        assert tokens[-1].finish_reason == "length"
        assert all(t.logprob is not None and len(t.top_logprobs) == 1 for t in tokens)

        seen = 0
        async for tok in engine.stream(prompt, dataclasses.replace(params, max_tokens=200)):
            seen += 1
            if seen == 7:
                break                                             # leaving the loop aborts it
        with anyio.fail_after(10):
            while engine.stats()["requests"] or engine.stats()["running"]:
                await anyio.sleep(0.01)
        stats = engine.stats()
        assert stats["kv_blocks_free"] == total and stats["waiting"] == 0
