"""The aggregation tasks (cwe, fwe): counts, lengths, determinism, scoring, the CLI."""

from __future__ import annotations

import io
import json
import re
import sys
from collections import Counter

import pytest

from astream.eval import AGGREGATION_TASKS, RULER_TASKS, build_trial, build_trials, score
from astream.eval.aggregation import COMMON_WORDS, FREQUENT_WORDS, common_repeats, zipf_counts
from astream.eval.problem import WORD
from astream.face.cli import main

ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--cpu-kv-cache-gib", "0.125"]


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


def _haystack(tok, trial) -> str:
    text = tok.decode(trial.prompt_ids)
    return text[text.index("\n\n") + 2:text.rindex("\n\n")]


def _counts(task: str, haystack: str) -> Counter:
    if task == "cwe":
        entries = re.findall(r"^(\d+)\. ([a-z]+)$", haystack, re.MULTILINE)
        assert [int(n) for n, _ in entries] == list(range(1, len(entries) + 1))
        assert len(entries) == haystack.count("\n") + 1
        return Counter(word for _, word in entries)
    return Counter(haystack.split(" "))


def _top(counts: Counter, size: int) -> set[str]:
    """The `size` most frequent items, each strictly ahead of every other item."""
    ranked = counts.most_common()
    assert ranked[size - 1][1] > ranked[size][1], "a tie at the edge of the answer"
    return {word for word, _ in ranked[:size]}


@pytest.mark.parametrize("length", [400, 1000, 3000])
def test_cwe_answer_is_the_strictly_most_common_words(tok, length):
    trial = build_trial(tok, "cwe", length, 0.5, index=1, seed=4)
    counts = _counts("cwe", _haystack(tok, trial))
    assert len(trial.expected) == COMMON_WORDS and _top(counts, COMMON_WORDS) == set(trial.expected)
    entries = sum(counts.values())
    assert {counts[w] for w in trial.expected} == {common_repeats(entries)}
    assert max(c for w, c in counts.items() if w not in trial.expected) <= 2


@pytest.mark.parametrize("length", [400, 1000, 3000])
def test_fwe_answer_is_the_strictly_most_frequent_coded_words(tok, length):
    trial = build_trial(tok, "fwe", length, 0.5, index=1, seed=4)
    counts = _counts("fwe", _haystack(tok, trial))
    assert len(trial.expected) == FREQUENT_WORDS and _top(counts, FREQUENT_WORDS) == set(trial.expected)
    assert sorted(counts.values(), reverse=True) == zipf_counts(max(counts.values()))


def test_the_counts_keep_the_answer_strict_at_every_size():
    for top in range(32, 5000):
        counts = zipf_counts(top)
        assert counts[FREQUENT_WORDS - 1] > counts[FREQUENT_WORDS]
    assert all(common_repeats(entries) > 2 for entries in range(40, 20000))
    assert all(COMMON_WORDS * common_repeats(entries) <= entries for entries in range(40, 20000))
    assert common_repeats(100_000) == 30


@pytest.mark.parametrize("task", AGGREGATION_TASKS)
@pytest.mark.parametrize("length", [400, 2048, 8192])
def test_prompt_length_is_near_the_asked_length(tok, task, length):
    for index in range(2):
        trial = build_trial(tok, task, length, 0.5, index)
        assert length - 16 <= len(trial.prompt_ids) <= length
        assert trial.needle_depth == 0.0


@pytest.mark.parametrize("task", AGGREGATION_TASKS)
def test_prompts_are_deterministic_and_depth_only_changes_the_seed(tok, task):
    first = build_trials(tok, [task], [600], [0.2, 0.8], trials=2, seed=7)
    again = build_trials(tok, [task], [600], [0.2, 0.8], trials=2, seed=7)
    assert [t.prompt_ids for t in first] == [t.prompt_ids for t in again]
    assert len({t.prompt_ids for t in first}) == 4
    assert len({t.expected for t in first}) == 4
    assert build_trial(tok, task, 600, 0.2, 0, seed=8).prompt_ids != first[0].prompt_ids


@pytest.mark.parametrize("task", AGGREGATION_TASKS)
def test_a_too_short_length_is_refused_with_the_reason(tok, task):
    with pytest.raises(ValueError, match="too short"):
        build_trial(tok, task, 120, 0.5, 0)


def test_word_answers_score_whole_words_ignoring_case():
    expected = ("kepoba", "serilo", "nabosi", "pebuku")
    assert score("1. Kepoba\n2. SERILO, nabosi and pebuku.", expected, WORD).score == 1.0
    partial = score("kepoba, nabosiz, serilo's", expected, WORD)
    assert partial.found == ("kepoba", "serilo") and partial.score == 0.5 and not partial.correct
    for wrong in ("", "kepobaserilo", "tamori, lukeva", "kepobax"):
        assert score(wrong, expected, WORD).score == 0.0, wrong


def test_the_ruler_default_leaves_the_aggregation_tasks_out(tmp_path, capsys):
    argv = ["eval", "ruler", "--tasks", "cwe,nosuchtask", "--out", str(tmp_path)]
    with pytest.raises(SystemExit):
        main(argv)
    assert "choose from distractor, multikey, multivalue, vartrack, cwe, fwe" in capsys.readouterr().err
    assert not set(AGGREGATION_TASKS) & set(RULER_TASKS)


def test_cli_runs_both_tasks_on_smollm2(tmp_path, tok):
    folder = tmp_path / "tokenizer"
    tok.save_pretrained(folder)
    capture = io.StringIO()
    stdout, sys.stdout = sys.stdout, capture
    try:
        code = main(["eval", "ruler", "--tasks", "cwe,fwe", "--lengths", "400", "--depths", "0.5",
                     "--trials", "1", "--out", str(tmp_path), "--tokenizer", str(folder), *ENGINE_FLAGS])
    finally:
        sys.stdout = stdout
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["task"], r["length"]) for r in rows] == [("cwe", 400), ("fwe", 400)]
    for row in rows:
        assert 384 <= row["prompt_tokens"] <= 400 and row["answer"]
        assert row["score"] == pytest.approx(len(row["found"]) / len(row["expected"]))
    assert re.search(r"cwe length\s+d=0.5\s+all", capture.getvalue())
