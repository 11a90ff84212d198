"""Generation behaviour on the embedded model: batching, prefix cache, preemption, sampling."""

from __future__ import annotations

import pytest

from astream import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)

EIGHT_PROMPTS = [
    "Hi",
    "Tell me a story about a dragon who loved to bake bread in a small village.",
    "List three colors:",
    "The meaning of life is",
    [{"role": "user", "content": "Name a planet."}],
    "Once upon a time, in a land far, far away, there lived a king who had three daughters. "
    "The youngest daughter was",
    "import numpy as np\n",
    [{"role": "user", "content": "Give me one word that rhymes with cat."}],
]


def test_batch_gives_same_tokens_as_alone(smol_llm):
    together = smol_llm.generate(EIGHT_PROMPTS, GREEDY)
    for prompt, out in zip(EIGHT_PROMPTS, together):
        alone = smol_llm.generate([prompt], GREEDY)[0]
        assert out.token_ids == alone.token_ids, f"prompt {prompt!r}"
        assert out.text == alone.text


def test_prefix_cache_reuses_three_blocks():
    llm = LLM(device="cpu", num_kv_blocks=256, kv_block_size=16)
    shared = list(range(1000, 1048))             # exactly three blocks of 16
    first = llm.generate([shared + [5, 6, 7]], GREEDY)[0]
    hits_before = llm.stats()["prefix_cache_hits"]
    second = llm.generate([shared + [5, 6, 7]], GREEDY)[0]
    assert llm.stats()["prefix_cache_hits"] - hits_before == 3
    assert second.token_ids == first.token_ids
    other = llm.generate([shared + [9, 9]], GREEDY)[0]
    assert llm.stats()["prefix_cache_hits"] - hits_before == 6
    fresh = LLM(device="cpu", num_kv_blocks=256, kv_block_size=16).generate([shared + [9, 9]], GREEDY)[0]
    assert other.token_ids == fresh.token_ids


def test_preemption_under_tiny_cache_gives_same_tokens(smol_llm):
    prompts = [f"Count slowly from {i} to {i + 30}:" for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    big = smol_llm.generate(prompts, params)
    small = LLM(device="cpu", num_kv_blocks=12, kv_block_size=16, max_model_len=128)
    tiny = small.generate(prompts, params)
    assert [o.token_ids for o in tiny] == [o.token_ids for o in big]
    assert small.stats()["preemptions"] > 0
    assert small.stats()["kv_blocks_free"] == 12


def test_seeded_sampling_is_reproducible_and_batch_independent(smol_llm):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=20,
                            ignore_eos=True)
    a = smol_llm.generate(["Once upon a time"], params)[0]
    b = smol_llm.generate(["Once upon a time", "Other prompt", "Third"],
                          [params, SamplingParams(temperature=1.0, max_tokens=20),
                           SamplingParams(seed=5, max_tokens=7)])[0]
    c = smol_llm.generate(["Once upon a time"], SamplingParams(temperature=0.9, top_p=0.9, top_k=50,
                                                               seed=99, max_tokens=20, ignore_eos=True))[0]
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_top_k_one_is_greedy(smol_llm):
    greedy = smol_llm.generate(["The sky is"], GREEDY)[0]
    top1 = smol_llm.generate(["The sky is"], SamplingParams(temperature=1.5, top_k=1, max_tokens=24))[0]
    assert top1.token_ids == greedy.token_ids


def test_max_tokens_stop_strings_and_stop_ids(smol_llm):
    base = smol_llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=12))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 12
    assert " 7" in base.text
    cut = smol_llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=12, stop=[" 7"]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == base.text[:base.text.index(" 7")]
    stop_id = base.token_ids[3]
    by_id = smol_llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=12,
                                                             stop_token_ids=[stop_id]))[0]
    assert by_id.finish_reason == "stop"
    assert by_id.token_ids == base.token_ids[:base.token_ids.index(stop_id) + 1]


def test_ignore_eos_runs_to_max_tokens(smol_llm):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    normal = smol_llm.generate([chat], SamplingParams(temperature=0, max_tokens=64))[0]
    assert normal.finish_reason == "stop" and len(normal.token_ids) < 64
    forced = smol_llm.generate([chat], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))[0]
    assert len(forced.token_ids) == 64 and forced.finish_reason == "length"


def test_utf8_is_never_broken(smol_llm):
    out = smol_llm.generate(["Écris une phrase en français avec des accents: é, è, à, ç. 日本語:"],
                            SamplingParams(temperature=0.8, seed=3, max_tokens=48))[0]
    assert "\ufffd" not in out.text
    full = smol_llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.text == full.rstrip("\ufffd")      # an unfinished last character is dropped


@pytest.mark.parametrize("max_tokens", [1, 5])
def test_no_step_is_spent_after_the_last_token_is_sampled(smol_llm, max_tokens):
    # The engine schedules step n+1 before step n's ids reach the host; a sequence whose
    # last token is already sampled must not get another forward pass (with offload that
    # pass would load its whole KV cache for nothing).
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = smol_llm.stats()["steps"]
    out = smol_llm.generate(["Count to ten: one, two,"], params)[0]
    assert len(out.token_ids) == max_tokens
    assert smol_llm.stats()["steps"] - before == max_tokens    # one prefill step, then decodes
