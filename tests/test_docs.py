"""docs/BENCHMARKS.md cites a result file for its figures: every one it names is in
benchmarks/results, so each figure can be checked against what the run wrote."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
TOPICS = {path.name for path in RESULTS.iterdir() if path.is_dir()}
CITED = re.compile(r"`([\w.{},*/-]+)`")


def _expand(name: str) -> list[str]:
    """a_{1,2}.json -> a_1.json, a_2.json (nested braces too)."""
    match = re.search(r"\{([^{}]*)\}", name)
    if match is None:
        return [name]
    return [out for alt in match.group(1).split(",")
            for out in _expand(name[:match.start()] + alt + name[match.end():])]


def cited_results(text: str) -> list[str]:
    """Names in backticks that stand for result files: a .json / .jsonl file, or a folder
    under one of the results' topics (eval/..., quest/...)."""
    names = []
    for name in CITED.findall(text):
        name = name.removeprefix("benchmarks/").removeprefix("results/")
        if name.endswith((".json", ".jsonl")) or (name.endswith("/") and name.split("/")[0] in TOPICS):
            names += _expand(name)
    return names


def exists(name: str) -> bool:
    if "/" not in name.rstrip("/"):                   # a bare file name, its folder said in prose
        return any(RESULTS.rglob(name))
    matches = list(RESULTS.glob(name.rstrip("/")))
    return any(m.is_dir() and any(m.iterdir()) if name.endswith("/") else m.is_file() for m in matches)


def test_the_name_reader_expands_braces_and_keeps_only_result_names():
    text = "`quest/a_{1,2}.json` `eval/run/` `python x.py` `x/{a,b}_{c,d}.json` `base/`"
    assert cited_results(text) == ["quest/a_1.json", "quest/a_2.json", "eval/run/", "x/a_c.json",
                                   "x/a_d.json", "x/b_c.json", "x/b_d.json"]


def test_every_result_file_the_benchmarks_page_cites_is_in_the_repository():
    cited = cited_results((REPO / "docs" / "BENCHMARKS.md").read_text())
    assert len(cited) > 50
    missing = sorted({name for name in cited if not exists(name)})
    assert not missing, f"docs/BENCHMARKS.md cites result files that are not in benchmarks/results: {missing}"
