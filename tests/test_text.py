"""Incremental detokenization and stop strings, without a model."""

from __future__ import annotations

import pytest

from astream.base.sampling import SamplingParams
from astream.text.request_text import IncrementalDetokenizer, RequestText

TEXT = "Écris une phrase: é, è, à, ç. 日本語 🙂 and more words, then\nnew lines."


@pytest.mark.parametrize("fast", [True, False], ids=["decode-stream", "window"])
def test_both_detokenizers_release_whole_characters_only(smollm2_tokenizer, fast):
    ids = smollm2_tokenizer(TEXT)["input_ids"]
    detok = IncrementalDetokenizer.start(smollm2_tokenizer, [1, 2, 3])
    if not fast:
        detok.stream = None
    assert (detok.stream is not None) == fast
    pieces = [detok.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == TEXT
    assert "" in pieces                               # some tokens end mid-character


def stream_text(tokenizer, text: str, params: SamplingParams) -> tuple[list[str], RequestText]:
    state = RequestText(params, IncrementalDetokenizer.start(tokenizer, [1]), frozenset({2}))
    pieces = []
    for count, token_id in enumerate(tokenizer(text)["input_ids"], 1):
        pieces.append(state.append(token_id, at_limit=count >= params.max_tokens))
        if state.finished:
            break
    return pieces, state


def test_stop_string_is_cut_and_never_partly_released(smollm2_tokenizer):
    pieces, state = stream_text(smollm2_tokenizer, "one two three STOP four five",
                                SamplingParams(stop=[" STOP"], max_tokens=50))
    assert state.finished == "stop"
    assert "".join(pieces) == "one two three"
    assert not any("ST" in p for p in pieces)


def test_max_tokens_and_eos_end_the_text(smollm2_tokenizer):
    pieces, state = stream_text(smollm2_tokenizer, "a b c d e f g h", SamplingParams(max_tokens=3))
    assert state.finished == "length" and len(pieces) == 3
    state = RequestText(SamplingParams(), IncrementalDetokenizer.start(smollm2_tokenizer, [1]),
                        frozenset({2}))
    state.append(smollm2_tokenizer("hi")["input_ids"][0], at_limit=False)
    assert state.append(2, at_limit=False) == "" and state.finished == "stop"
