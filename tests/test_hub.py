"""Models by Hugging Face hub id: resolved from a local cache when offline, local paths
first, and a clear error when the id is in neither place."""

from __future__ import annotations

import shutil

import pytest

from astream import LLM, SamplingParams
from astream.models.hub import looks_like_hub_id

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
KW = dict(device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=512)
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def offline_cache(tmp_path, monkeypatch, tiny_qwen3):
    """A Hugging Face cache holding tiny_qwen3 as 'astream-test/tiny-qwen3', offline."""
    repo = tmp_path / "hub" / "models--astream-test--tiny-qwen3"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(tiny_qwen3, repo / "snapshots" / COMMIT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)                   # no local folder of that name
    return tmp_path


def test_a_hub_id_loads_from_the_offline_cache(offline_cache, tiny_qwen3):
    with LLM(str(tiny_qwen3), **KW) as llm:
        want = llm.generate(["Hello there"], GREEDY)[0].token_ids
    with LLM("astream-test/tiny-qwen3", **KW) as llm:
        assert llm.generate(["Hello there"], GREEDY)[0].token_ids == want


def test_a_local_folder_wins_over_the_hub(offline_cache, tiny_qwen3):
    local = offline_cache / "astream-test" / "missing-on-hub"
    shutil.copytree(tiny_qwen3, local)
    with LLM("astream-test/missing-on-hub", **KW) as llm:
        assert len(llm.generate(["Hi"], GREEDY)[0].token_ids) == 8


def test_an_id_in_neither_place_says_why(offline_cache):
    with pytest.raises(FileNotFoundError, match="'astream-test/absent' is not a local path and is "
                       "not in .*HF_HUB_OFFLINE is set"):
        LLM("astream-test/absent", **KW)


@pytest.mark.parametrize("text, hub", [("Qwen/Qwen2.5-0.5B-Instruct", True), ("org/name.v2", True),
                                       ("./org/name", False), ("/abs/path", False), ("a/b/c", False),
                                       ("org/model.gguf", False), ("name", False), ("~/x", False)])
def test_what_counts_as_a_hub_id(text, hub):
    assert looks_like_hub_id(text) is hub


def test_serve_takes_the_model_as_an_argument():
    from astream.face.cli import _configs, build_parser
    args = build_parser().parse_args(["serve", "Qwen/Qwen2.5-0.5B-Instruct", "--port", "0"])
    _configs(args)
    assert args.model == "Qwen/Qwen2.5-0.5B-Instruct"
    args = build_parser().parse_args(["serve", "org/one", "--model", "org/two"])
    with pytest.raises(ValueError, match="two models given"):
        _configs(args)
