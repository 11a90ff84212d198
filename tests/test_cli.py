"""The `astream` command, run as a user would: a subprocess on the embedded model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from astream import SamplingParams
from astream.stages.graph import STAGES

ROOT = Path(__file__).resolve().parents[1]
ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "512",
                "--max-model-len", "2048"]
GREEDY_FLAGS = ["--temperature", "0", "--max-tokens", "8"]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def astream(*args: str, stdin: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "astream.cli", *args], cwd=ROOT, env=env, input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def test_generate_streams_the_same_text_as_llm(smol_llm):
    prompt = "The quick brown fox"
    expected = smol_llm.generate([prompt], GREEDY)[0].text
    result = astream("generate", *ENGINE_FLAGS, *GREEDY_FLAGS, prompt)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"
    assert "loading weights" in result.stderr             # progress goes to stderr, not stdout


def test_chat_keeps_the_history(smol_llm):
    first = [{"role": "user", "content": "What is the capital of France?"}]
    reply = smol_llm.generate([first], GREEDY)[0].text
    second = first + [{"role": "assistant", "content": reply},
                      {"role": "user", "content": "And of Italy?"}]
    reply2 = smol_llm.generate([second], GREEDY)[0].text
    result = astream("chat", *ENGINE_FLAGS, *GREEDY_FLAGS,
                     stdin="What is the capital of France?\n\nAnd of Italy?\n/exit\nnever read\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"> {reply}\n> > {reply2}\n> "


def test_generate_chat_flag_applies_the_template(smol_llm):
    question = "What is the capital of France?"
    expected = smol_llm.generate([[{"role": "user", "content": question}]], GREEDY)[0].text
    result = astream("generate", "--chat", *ENGINE_FLAGS, *GREEDY_FLAGS, "-", stdin=question)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"


def test_graph_lists_the_stages():
    result = astream("graph")
    assert result.returncode == 0, result.stderr
    for stage in STAGES:
        assert stage.name in result.stdout


@pytest.mark.parametrize("args, message", [
    ([], "required: COMMAND"),
    (["summon"], "invalid choice: 'summon'"),
    (["generate"], "required: prompt"),
    (["generate", "--max-tokens", "0", "hi"], "max_tokens must be an integer >= 1"),
    (["generate", "--temperature", "warm", "hi"], "invalid float value: 'warm'"),
    (["generate", "--max-num-seqs", "0", "hi"], "max_num_seqs must be a positive integer"),
    (["generate", "--dtype", "int3", "hi"], "unknown dtype 'int3'"),
    (["serve", "--max-frame-bytes", "-1"], "max_frame_bytes must be a positive integer"),
    (["generate", "--model", "/no/such/model", "hi"], "model path does not exist"),
])
def test_bad_arguments_exit_nonzero_with_a_message(args, message):
    result = astream(*args)
    assert result.returncode != 0
    assert message in result.stderr
    assert result.stdout == ""
