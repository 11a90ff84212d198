"""Long-context evaluation (astream.eval): prompts, tasks, scoring, config specs, the CLI."""

from __future__ import annotations

import io
import json
import random
import re
import sys

import pytest

from astream.eval import (NEEDLE, RULER_TASKS, CellResult, EvalRun, TrialResult, build_trial, build_trials,
                          format_summary, parse_configs, parse_depths, parse_lengths, score, summary,
                          write_outputs)
from astream.eval.filler import filler_sentences
from astream.eval.problem import NAME, NUMBER
from astream.eval.progress import ProgressBar
from astream.face.cli import main

ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--cpu-kv-cache-gib", "0.125"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def longest_sentence(tok) -> int:
    """Tokens of the longest filler sentence: the tolerance on lengths and depths."""
    sentences = filler_sentences(random.Random(0), 2000)
    return max(len(ids) for ids in tok([" " + s for s in sentences], add_special_tokens=False)["input_ids"])


def _haystack_span(text: str) -> tuple[int, int]:
    """The haystack is the user message between its intro and its question (blank lines)."""
    return text.index("\n\n") + 2, text.rindex("\n\n")


# ---- haystacks -----------------------------------------------------------------------------

@pytest.mark.parametrize("length,depth", [(1024, 0.1), (1024, 0.5), (2048, 0.0), (2048, 1.0), (4096, 0.7)])
def test_needle_prompt_has_the_length_depth_and_one_key(tok, longest_sentence, length, depth):
    trial = build_trial(tok, NEEDLE, length, depth, index=0, seed=3)
    assert length - longest_sentence <= len(trial.prompt_ids) <= length
    text = tok.decode(trial.prompt_ids)
    key = trial.expected[0]
    assert 5 <= len(key) <= 7 and text.count(key) == 1

    encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert len(encoded["input_ids"]) == len(trial.prompt_ids)
    starts = [start for start, _ in encoded["offset_mapping"]]
    begin, end = _haystack_span(text)
    needle = text.index(f"The pass key is {key}")
    before = sum(begin <= s < needle for s in starts)
    haystack = sum(begin <= s < end for s in starts)
    assert abs(before / haystack - depth) <= longest_sentence / haystack


def test_prompt_is_one_chat_turn_with_the_question_last(tok):
    text = tok.decode(build_trial(tok, NEEDLE, 600, 0.5, 0).prompt_ids)
    head, tail = tok.apply_chat_template([{"role": "user", "content": "@@"}], add_generation_prompt=True,
                                         tokenize=False).split("@@")
    assert text.startswith(head)
    assert text.endswith("What is the pass key? Answer with the number only." + tail)


def test_without_a_chat_template_the_prompt_is_plain_text(tok, monkeypatch, longest_sentence):
    monkeypatch.setattr(tok, "chat_template", None)
    trial = build_trial(tok, NEEDLE, 600, 0.5, 0)
    text = tok.decode(trial.prompt_ids, skip_special_tokens=True)
    assert "<|im_start|>" not in tok.decode(trial.prompt_ids)
    assert text.endswith("What is the pass key? Answer with the number only.")
    assert 600 - longest_sentence <= len(trial.prompt_ids) <= 600


def test_filler_is_varied_and_has_no_digits():
    sentences = filler_sentences(random.Random(1), 200)
    assert len(set(sentences)) > 150
    assert not any(ch.isdigit() for s in sentences for ch in s)


def test_a_cell_alone_gets_the_same_prompts_as_inside_a_grid(tok):
    grid = build_trials(tok, [NEEDLE, "vartrack"], [400, 700], [0.2, 0.8], trials=2, seed=5)
    alone = build_trials(tok, ["vartrack"], [700], [0.8], trials=2, seed=5)
    in_grid = [t for t in grid if t.cell == ("vartrack", 700, 0.8)]
    assert [t.prompt_ids for t in in_grid] == [t.prompt_ids for t in alone]
    assert in_grid[0].expected != in_grid[1].expected                 # each trial its own answer
    other_seed = build_trial(tok, "vartrack", 700, 0.8, 0, seed=6)
    assert other_seed.prompt_ids != alone[0].prompt_ids


def test_a_too_short_length_is_refused_with_the_reason(tok):
    with pytest.raises(ValueError, match="too short"):
        build_trial(tok, "multikey", 100, 0.5, 0)


# ---- RULER-style tasks: the answer follows from the prompt --------------------------------

def _codes(text: str) -> list[tuple[str, str]]:
    return re.findall(r"secret codes? of the ([a-z]+-[a-z]+) is (\d+)\.", text)


def _solve(task: str, text: str) -> set[str]:
    """Recompute the answer from the prompt text alone."""
    if task in ("distractor", "multikey"):
        name = re.search(r"What is the secret code of the ([a-z]+-[a-z]+)\?", text)[1]
        table = dict(_codes(text))
        assert len(table) == len(_codes(text)), "a name has two codes"
        return {table[name]}
    if task == "multivalue":
        name = re.search(r"What are all the secret codes of the ([a-z]+-[a-z]+)\?", text)[1]
        return {value for key, value in _codes(text) if key == name}
    value = re.search(r"Which variables are equal to (\d+)\?", text)[1]
    assigned = dict(re.findall(r"Let ([A-Z]{5}) = (\w+)\.", text))

    def resolve(name: str) -> str:
        while name in assigned:
            name = assigned[name]
        return name
    return {name for name in assigned if resolve(name) == value}


@pytest.mark.parametrize("task", RULER_TASKS)
@pytest.mark.parametrize("length,depth", [(1024, 0.3), (3000, 0.9)])
def test_ruler_answer_is_recoverable_from_the_prompt(tok, task, length, depth):
    trial = build_trial(tok, task, length, depth, index=1, seed=2)
    text = tok.decode(trial.prompt_ids)
    assert _solve(task, text) == set(trial.expected)
    counts = {"distractor": 4, "multikey": max(8, length // 256), "multivalue": 6}
    if task in counts:
        assert len(_codes(text)) == counts[task]
    else:
        assert len(trial.expected) == 5 and len(re.findall(r"Let [A-Z]{5} = ", text)) == 8


# ---- scoring, specs, progress ---------------------------------------------------------------

def test_scoring_counts_whole_numbers_and_names_only():
    assert score("The pass key is 48213.", ("48213",), NUMBER).correct
    for wrong in ("148213", "482130", "4821 3", "48,213", ""):
        assert not score(wrong, ("48213",), NUMBER).correct, wrong
    partial = score("12, 34 and 5", ("12", "34", "56"), NUMBER)
    assert partial.found == ("12", "34") and partial.score == pytest.approx(2 / 3) and not partial.correct
    assert score("QHZTK, ABCDE", ("ABCDE", "QHZTK"), NAME).correct
    assert not score("QHZTKX", ("QHZTK",), NAME).correct


def test_lengths_and_depths_parse():
    assert parse_lengths("1K,4096, 32k") == [1024, 4096, 32768]
    assert parse_depths("0,0.5,1") == [0.0, 0.5, 1.0]
    for bad in ("", "4M", "0", "1.5K", "1K,,2K", "-5"):
        with pytest.raises(ValueError, match="length"):
            parse_lengths(bad)
    for bad in ("1.5", "x", "0.1,"):
        with pytest.raises(ValueError, match="depth"):
            parse_depths(bad)


def test_config_specs_map_to_engine_options():
    configs = parse_configs("full,offload,quest:1024,quest:2048+offload")
    assert [(c.name, c.engine_kwargs) for c in configs] == [
        ("full", {"sparse_policy": "full", "offload": False}),
        ("offload", {"sparse_policy": "full", "offload": True}),
        ("quest:1024", {"sparse_policy": "quest", "sparse_budget": 1024, "offload": False}),
        ("quest:2048+offload", {"sparse_policy": "quest", "sparse_budget": 2048, "offload": True})]
    assert [c.budget for c in configs] == [None, None, 1024, 2048]
    fp8 = parse_configs("fp8,quest:2048+fp8_e5m2+offload")
    assert [(c.name, c.engine_kwargs) for c in fp8] == [
        ("fp8", {"sparse_policy": "full", "offload": False, "kv_cache_dtype": "fp8_e4m3"}),
        ("quest:2048+fp8_e5m2+offload", {"sparse_policy": "quest", "offload": True,
                                         "sparse_budget": 2048, "kv_cache_dtype": "fp8_e5m2"})]


@pytest.mark.parametrize("spec", ["", "full,", "quest:", "quest:0", "quest:x", "quest::1", "+offload",
                                  "quest:1024+other", "offload+offload", "full,full", "quest 1024",
                                  "fp8+fp8_e5m2"])
def test_malformed_config_specs_are_refused(spec):
    with pytest.raises(ValueError, match="--compare"):
        parse_configs(spec)


def test_progress_bar_writes_only_its_final_state_when_not_a_terminal():
    stream = io.StringIO()
    bar = ProgressBar(stream, total=3)
    for correct in (True, False, True):
        bar.advance(correct, "[full]")
    assert stream.getvalue().count("trials") == 1
    assert "3/3 trials, 2 correct [full]" in stream.getvalue()


def _answered(config: str, trials, answers: list[str]) -> CellResult:
    """A cell as if the engine had given `answers`, in 2 s of prefill and 1 s of decode."""
    results = [TrialResult(config, t, answer=a, generated_tokens=5) for t, a in zip(trials, answers)]
    for r in results:
        verdict = score(r.answer, r.trial.expected, r.trial.kind)
        r.found, r.score, r.correct = verdict.found, verdict.score, verdict.correct
    return CellResult(config, *trials[0].cell, results, prefill_s=2.0, decode_s=1.0)


def test_without_matplotlib_all_but_the_plot_is_written(tok, tmp_path, monkeypatch):
    trials = build_trials(tok, [NEEDLE], [300], [0.5], trials=2)
    run = EvalRun(trials, [_answered("full", trials, [f"It is {trials[0].expected[0]}.", "I do not know."])])
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # import matplotlib now fails
    write_outputs(run, tmp_path)
    assert not list(tmp_path.glob("*.png"))
    assert 'pip install "astream[eval]"' in run.notes[0]
    cell = json.loads((tmp_path / "summary.json").read_text())["full"]["cells"][0]
    assert cell["accuracy"] == 0.5
    assert cell["prefill_tok_s"] == pytest.approx(sum(len(t.prompt_ids) for t in trials) / 2.0, abs=0.1)
    assert cell["decode_tok_s"] == 8.0                                # (5 - 1) * 2 tokens / 1 s
    assert cell["trials"] == 2 and "prompt_tokens" not in cell        # per trial or total, named so
    assert cell["prompt_tokens_total"] == sum(len(t.prompt_ids) for t in trials)
    assert cell["prompt_tokens_per_trial"] == pytest.approx(cell["prompt_tokens_total"] / 2, abs=0.05)
    assert 250 <= cell["prompt_tokens_per_trial"] <= 300
    assert re.search(r"300\s+50%\s+50%", format_summary(run.cells))


def test_several_configurations_get_one_table_and_one_plot(tok, tmp_path):
    trials = build_trials(tok, ["multikey", "vartrack"], [400, 600], [0.5], trials=1)
    cells = [_answered(config, [t], [" ".join(t.expected) if right else "no idea"])
             for config, right in (("full", True), ("quest:64+offload", False)) for t in trials]
    run = EvalRun(trials, cells)
    write_outputs(run, tmp_path)
    for name in ("compare.png", "heatmap-full.png", "heatmap-quest_64_offload.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG_MAGIC)
    table = format_summary(cells).split("accuracy by configuration (same prompts")[1]
    assert re.search(r"task\s+length\s+full\s+quest:64\+offload", table)
    for task in ("multikey", "vartrack"):
        for length in (400, 600):
            assert re.search(rf"{task}\s+{length}\s+100%\s+0%", table)
    assert re.search(r"vs full\s+points\s+-100\.0 ± 0\.0", table)       # every prompt lost


def test_the_difference_from_the_first_configuration_is_paired_by_prompt(tok, tmp_path):
    """Two configurations that each answer half the prompts: alike in accuracy, but on the
    same half (difference 0 ± 0) or on the other half (0 ± 58 points over 4 prompts)."""
    trials = build_trials(tok, [NEEDLE], [300], [0.25, 0.75], trials=2)
    right = [" ".join(t.expected) for t in trials]
    wrong = ["no idea"] * len(trials)
    half = [right[0], right[1], wrong[2], wrong[3]]
    other = [wrong[0], wrong[1], right[2], right[3]]

    def cells(*answers):
        return [_answered(config, trials[i:i + 2], given[i:i + 2])
                for config, given in zip(("full", "sparse"), answers) for i in (0, 2)]
    same = summary(cells(half, half))["sparse"]["against_first"]
    assert same == {"config": "full", "points": 0.0, "standard_error_points": 0.0, "pairs": 4}
    apart = summary(cells(half, other))["sparse"]["against_first"]
    assert (apart["points"], apart["pairs"]) == (0.0, 4)
    assert apart["standard_error_points"] == pytest.approx(100 * (4 / 3) ** 0.5 / 2, abs=0.01)
    assert "against_first" not in summary(cells(half, other))["full"]
    assert re.search(r"vs full\s+points\s+\+0\.0 ± 57\.7", format_summary(cells(half, other)))


def test_report_reads_stopped_and_separate_runs_back_into_the_same_tables(tok, tmp_path, capsys):
    """Two runs' results.jsonl give the tables and paired differences of their cells taken
    together; a trial the second run repeats takes its row; the files hold no timing."""
    from astream.eval.report import ResultsFile, load_results
    trials = build_trials(tok, [NEEDLE], [300], [0.25, 0.75], trials=2)
    right, wrong = [" ".join(t.expected) for t in trials], ["no idea"] * 4
    first = [_answered("full", trials[:2], right[:2]), _answered("sparse", trials[:2], wrong[:2])]
    second = [_answered("full", trials[2:], right[2:]), _answered("sparse", trials[2:], right[2:]),
              _answered("sparse", trials[:1], right[:1])]        # trial 0 again, now right
    for folder, cells in (("a", first), ("b", second)):
        results = ResultsFile(tmp_path / folder / "results.jsonl")
        for cell in cells:
            results.write_cell(cell)
    loaded = load_results([tmp_path / "a", tmp_path / "b" / "results.jsonl"])
    assert [(c.config, c.depth, len(c.results)) for c in loaded] == [
        ("full", 0.25, 2), ("sparse", 0.25, 2), ("full", 0.75, 2), ("sparse", 0.75, 2)]
    wanted = summary(first[:1] + second[:2] + [_answered("sparse", trials[:2], [right[0], wrong[1]])])
    got = summary(loaded)
    for config in ("full", "sparse"):
        assert got[config]["accuracy"] == wanted[config]["accuracy"]
        assert got[config]["prefill_tok_s"] is None and got[config]["decode_tok_s"] is None
    assert got["sparse"]["accuracy"] == 0.75
    assert got["sparse"]["against_first"] == {**wanted["sparse"]["against_first"], "pairs": 4}
    assert got["sparse"]["against_first"]["points"] == -25.0

    assert main(["eval", "report", str(tmp_path / "a"), str(tmp_path / "b"), "--out",
                 str(tmp_path / "both")]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"vs full\s+points\s+-25\.0 ± 25\.0", printed)
    assert re.search(r"prefill\s+tok/s\s+-\s+-", printed)
    assert json.loads((tmp_path / "both" / "summary.json").read_text())["sparse"]["accuracy"] == 0.75

    (tmp_path / "bad.jsonl").write_text('{"config": "full"}\n')
    assert main(["eval", "report", str(tmp_path / "bad.jsonl")]) == 1
    assert "bad.jsonl:1: not a trial row" in capsys.readouterr().err
    assert main(["eval", "report", str(tmp_path / "missing")]) == 1
    assert "no results.jsonl there" in capsys.readouterr().err


def test_report_refuses_one_name_for_rows_of_different_policies(tok, tmp_path, capsys):
    """"quest" rows from before and after a default changed: the report names both policies
    instead of pairing them as one configuration; a run that names one of them apart reads."""
    from astream.eval.report import ResultsFile
    trials = build_trials(tok, [NEEDLE], [300], [0.25, 0.75], trials=1)
    answers = [" ".join(t.expected) for t in trials]
    for folder, trial, answer, policy in (("old", trials[0], answers[0], "QuestPolicy(gqa_reduce='max')"),
                                          ("new", trials[1], answers[1], "QuestPolicy(gqa_reduce='relative')")):
        cell = _answered("quest", [trial], [answer])
        cell.results[0].policy = policy
        ResultsFile(tmp_path / folder / "results.jsonl").write_cell(cell)
    assert main(["eval", "report", str(tmp_path / "old"), str(tmp_path / "new")]) == 1
    err = capsys.readouterr().err
    assert "configuration 'quest' has rows of different sparse policies" in err
    assert "gqa_reduce='max'" in err and "gqa_reduce='relative'" in err
    renamed = [{**row, "config": "quest-max"} for row in _rows(tmp_path / "old")]
    (tmp_path / "old" / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in renamed))
    assert main(["eval", "report", str(tmp_path / "old"), str(tmp_path / "new")]) == 0


def test_a_configuration_that_did_not_run_a_cell_shows_no_accuracy_there(tok):
    trials = build_trials(tok, ["multikey", "vartrack"], [400], [0.5], trials=1)
    cells = [_answered("full", [t], [" ".join(t.expected)]) for t in trials]
    cells.append(_answered("sparse", trials[:1], [" ".join(trials[0].expected)]))
    table = format_summary(cells).split("accuracy by configuration")[1]
    assert re.search(r"multikey\s+400\s+100%\s+100%", table)
    assert re.search(r"vartrack\s+400\s+100%\s+-", table)


# ---- the CLI on SmolLM2 ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer_dir(tok, tmp_path_factory):
    """The converted GGUF tokenizer, saved once: each engine would convert it again otherwise."""
    folder = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(folder)
    return str(folder)


def _rows(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def needle_run(tmp_path_factory, tokenizer_dir):
    out = tmp_path_factory.mktemp("needle")
    capture = io.StringIO()
    stdout, sys.stdout = sys.stdout, capture
    try:
        code = main(["eval", "needle", "--lengths", "1K", "--depths", "0.1,0.5,0.9", "--trials", "1",
                     "--seed", "11", "--out", str(out), "--tokenizer", tokenizer_dir, *ENGINE_FLAGS])
    finally:
        sys.stdout = stdout
    assert code == 0
    return out, capture.getvalue()


def test_cli_finds_the_key_at_1k_and_writes_results_and_heatmap(needle_run):
    out, printed = needle_run
    rows = _rows(out)
    cells = [(r["config"], r["length"], r["depth"]) for r in rows]
    assert cells == [("full", 1024, depth) for depth in (0.1, 0.5, 0.9)]
    for row in rows:
        assert row["policy"] == "FullPolicy()"                     # what the engine ran
        assert 1000 <= row["prompt_tokens"] <= 1024
        whole = re.findall(r"\d+", row["answer"])
        assert row["correct"] == (row["expected"][0] in whole)
    assert sum(row["correct"] for row in rows) >= 2
    assert (out / "heatmap.png").read_bytes().startswith(PNG_MAGIC)
    assert re.search(r"needle length\s+d=0.1\s+d=0.5\s+d=0.9\s+all", printed)
    assert "prefill" in printed and "tok/s" in printed


def test_cli_reruns_one_cell_with_offload_on_the_same_prompt(needle_run, tmp_path, tokenizer_dir):
    first, _ = needle_run
    code = main(["eval", "needle", "--lengths", "1K", "--depths", "0.5", "--trials", "1", "--seed", "11",
                 "--compare", "offload", "--out", str(tmp_path), "--tokenizer", tokenizer_dir, *ENGINE_FLAGS])
    assert code == 0
    before = next(r for r in _rows(first) if r["depth"] == 0.5)
    (row,) = _rows(tmp_path)
    assert row["config"] == "offload"
    assert (row["prompt_sha1"], row["prompt_tokens"]) == (before["prompt_sha1"], before["prompt_tokens"])
    assert (tmp_path / "heatmap.png").read_bytes().startswith(PNG_MAGIC)


def test_cli_resumes_a_stopped_run_running_only_the_cells_it_lacks(needle_run, tmp_path, tokenizer_dir,
                                                                   capsys):
    first, _ = needle_run
    rows = _rows(first)
    # A run that stopped after two of its three cells (their answers marked, to see they stay).
    kept = [{**row, "answer": "kept"} for row in rows if row["depth"] != 0.5]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in kept))
    flags = ["eval", "needle", "--lengths", "1K", "--depths", "0.1,0.5,0.9", "--trials", "1",
             "--out", str(tmp_path), "--tokenizer", tokenizer_dir, "--resume", *ENGINE_FLAGS]
    assert main([*flags, "--seed", "11"]) == 0
    assert "resumed: 2 cell(s) kept" in capsys.readouterr().err
    after = _rows(tmp_path)
    assert [(r["depth"], r["answer"]) for r in after[:2]] == [(0.1, "kept"), (0.9, "kept")]
    (new,) = after[2:]
    assert (new["depth"], new["prompt_sha1"]) == (0.5, next(r for r in rows if r["depth"] == 0.5)["prompt_sha1"])
    cells = json.loads((tmp_path / "summary.json").read_text())["full"]["cells"]
    assert [c["depth"] for c in cells] == [0.1, 0.5, 0.9]
    assert main([*flags, "--seed", "11"]) == 0                    # nothing left: no engine, no rows
    assert "resumed: 3 cell(s) kept" in capsys.readouterr().err and len(_rows(tmp_path)) == 3
    # Other prompts (another seed) keep nothing: every cell runs, appended after the old rows.
    assert main([*flags, "--seed", "12", "--depths", "0.5"]) == 0
    assert "resumed" not in capsys.readouterr().err
    assert len(_rows(tmp_path)) == 4 and _rows(tmp_path)[3]["seed"] == 12


def test_cli_resume_runs_again_a_cell_its_file_holds_under_another_policy(needle_run, tmp_path,
                                                                            tokenizer_dir, capsys):
    """A cell whose rows ran another policy than the configuration now resolves to (a default
    changed since) is not kept: it runs again, and its new row supersedes the old one."""
    first, _ = needle_run
    rows = [{**row, "policy": "QuestPolicy(gqa_reduce='max')"} if row["depth"] == 0.9 else row
            for row in _rows(first)]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["eval", "needle", "--lengths", "1K", "--depths", "0.1,0.5,0.9", "--trials", "1",
                 "--seed", "11", "--out", str(tmp_path), "--tokenizer", tokenizer_dir, "--resume",
                 *ENGINE_FLAGS]) == 0
    assert "resumed: 2 cell(s) kept" in capsys.readouterr().err
    last = _rows(tmp_path)[-1]
    assert (last["depth"], last["policy"]) == (0.9, "FullPolicy()")
    assert main(["eval", "report", str(tmp_path)]) == 0            # the old row is superseded


def test_cli_reports_what_the_sparse_policies_did(tmp_path, tokenizer_dir):
    code = main(["eval", "needle", "--lengths", "1K", "--depths", "0.5", "--trials", "1", "--seed", "11",
                 "--compare", "xattention+quest:256", "--out", str(tmp_path), "--tokenizer", tokenizer_dir,
                 *ENGINE_FLAGS])
    assert code == 0
    (cell,) = json.loads((tmp_path / "summary.json").read_text())["xattention+quest:256"]["cells"]
    assert 0 < cell["xattention_density"] <= 1
    assert cell["quest_pages_per_selection"] == 256 / 16


@pytest.mark.parametrize("flags,message", [
    (["--compare", "full,offload", "--offload"], "--compare sets the sparse policy and offload"),
    (["--compare", "full,nosuchpolicy"], "--compare item 'nosuchpolicy': unknown sparse_policy"),
    (["--max-model-len", "512"], "(prompt and answer) but max_model_len is 512")])
def test_cli_refuses_bad_settings_before_loading_the_model(tmp_path, capsys, tokenizer_dir, flags, message):
    argv = ["eval", "needle", "--lengths", "1K", "--depths", "0.5", "--trials", "1", "--seed", "11",
            "--out", str(tmp_path), "--tokenizer", tokenizer_dir, *ENGINE_FLAGS, *flags]
    try:
        code = main(argv)
    except SystemExit as exc:               # argparse refuses a bad --compare value itself
        code = exc.code
    assert code in (1, 2)
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
