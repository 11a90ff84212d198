"""The `astream` command, run as a user would: a subprocess on the embedded model."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import astream as astream_package
from astream import SamplingParams
from astream.face.cli import build_parser, main
from astream.stages.graph import STAGES

ROOT = Path(__file__).resolve().parents[1]
ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "512",
                "--max-model-len", "2048"]
GREEDY_FLAGS = ["--temperature", "0", "--max-tokens", "8"]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def astream(*args: str, stdin: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {name: value for name, value in os.environ.items() if not name.startswith("ASTREAM_")
           or name == "ASTREAM_CACHE_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "astream.face.cli", *args], cwd=ROOT, env=env, input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def test_generate_raw_streams_the_same_text_as_llm(smol_llm):
    prompt = "The quick brown fox"
    expected = smol_llm.generate([prompt], GREEDY)[0].text
    result = astream("generate", "--raw", "--show-progress", *ENGINE_FLAGS, *GREEDY_FLAGS, prompt)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"
    assert "astream: loaded SmolLM2-135M-Instruct (embedded) in" in result.stderr   # not stdout


def test_generate_chats_by_default_and_reports_with_verbose(smol_llm):
    question = "What is the capital of France?"
    expected = smol_llm.generate([[{"role": "user", "content": question}]], GREEDY)[0].text
    result = astream("generate", "--verbose", *ENGINE_FLAGS, *GREEDY_FLAGS, question)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"
    assert "loaded" not in result.stderr                    # stderr is no terminal: no progress
    for line in ("prompt tokens:", "generated tokens:    8", "time to first token:", "decode speed:",
                 "peak memory:"):
        assert line in result.stderr


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


def test_chat_commands_system_prompt_and_reset(smol_llm):
    system = {"role": "system", "content": "You are a pirate."}
    hi = {"role": "user", "content": "Hi"}
    as_pirate = smol_llm.generate([[system, hi]], GREEDY)[0].text
    plain = smol_llm.generate([[hi]], GREEDY)[0].text
    assert as_pirate != plain
    result = astream("chat", "--system", "You are a pirate.", *ENGINE_FLAGS, *GREEDY_FLAGS,
                     stdin="/help\nHi\n/reset\nHi\n/system\nHi\n/bogus\n")
    assert result.returncode == 0, result.stderr
    # /reset forgets the first exchange but keeps the system prompt; /system alone drops it;
    # EOF ends the last prompt's line.
    assert result.stdout == f"> > {as_pirate}\n> > {as_pirate}\n> > {plain}\n> > \n"
    for text in ("/reset", "/system TEXT", "/exit", "(conversation cleared)",
                 "(system prompt removed; conversation cleared)", "unknown command /bogus"):
        assert text in result.stderr


@pytest.mark.parametrize("flag", ["--chat", "--raw"])
def test_generate_chat_and_raw_flags(smol_llm, flag):
    question = "What is the capital of France?"
    prompt = [{"role": "user", "content": question}] if flag == "--chat" else question
    expected = smol_llm.generate([prompt], GREEDY)[0].text
    result = astream("generate", flag, *ENGINE_FLAGS, *GREEDY_FLAGS, "-", stdin=question)
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
    (["generate", "--max-tokens", "0", "hi"], "argument --max-tokens: must be an integer >= 1"),
    (["generate", "--temperature", "warm", "hi"], "invalid float value: 'warm'"),
    (["generate", "--max-num-seqs", "0", "hi"], "argument --max-num-seqs: must be a positive integer"),
    (["generate", "--dtype", "int3", "hi"], "argument --dtype: unknown dtype 'int3'"),
    (["serve", "--max-frame-bytes", "-1"], "argument --max-frame-bytes: must be a positive integer"),
    (["generate", "--model", "/no/such/model", "hi"], "model path does not exist"),
])
def test_bad_arguments_exit_nonzero_with_a_message(args, message):
    result = astream(*args)
    assert result.returncode != 0
    assert message in result.stderr
    assert result.stdout == ""


def test_version():
    result = astream("--version")
    assert result.returncode == 0
    assert result.stdout == f"astream {astream_package.__version__}\n"


def _parsers(parser: argparse.ArgumentParser, name: str = "astream"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_every_option_of_every_command_says_what_it_does():
    missing = []
    for name, parser in _parsers(build_parser()):
        for action in parser._actions:
            if not action.option_strings or action.dest in ("help", "version"):
                continue
            text = (action.help or "").strip()
            if not re.sub(r"\(?default: [^)]*\)?", "", text).strip(" ;,.()"):
                missing.append(f"{name} {action.option_strings[0]}: {text!r}")
    assert not missing, "options without a description:\n" + "\n".join(missing)


def test_help_mentions_raw_chat_default_and_settings(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--raw plain completion" in out and "chat template" in out
    assert "ASTREAM_MAX_MODEL_LEN" in out and "--config FILE" in out


@pytest.mark.parametrize("args, env, message", [
    (["generate", "--max-tokens", "-5", "hi"], {},
     "argument --max-tokens: must be an integer >= 1 and < 2^31, got -5"),
    (["generate", "--sparse-policy", "bogus", "hi"], {},
     "argument --sparse-policy: unknown sparse policy 'bogus'; use one of ['flexprefill', 'full', "
     "'minference', 'quest', 'window', 'xattention']\n"),
    (["generate", "--kv-cache-scale", "2", "hi"], {},
     "argument --kv-cache-scale: applies to an fp8 --kv-cache-dtype only"),
    (["serve", "--port", "70000"], {}, "argument --port: must be in [0, 65535], got 70000"),
    (["generate", "--n", "2", "hi"], {}, "argument --n: a terminal shows one completion"),
    (["generate", "hi"], {"ASTREAM_MAX_TOKENS": "0"}, "$ASTREAM_MAX_TOKENS: must be an integer >= 1"),
    (["generate", "hi"], {"ASTREAM_TOP_K": "many"}, "$ASTREAM_TOP_K: expected an integer, got 'many'"),
])
def test_errors_name_the_flag_under_the_subcommands_usage(capsys, monkeypatch, args, env, message):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: astream {args[0]} [-h]")
    assert f"astream {args[0]}: error: {message}" in err
    assert "SparsePolicy" not in err and "max_tokens" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_says_the_flag_to_use(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--device", "cuda", "hi"])
    err = capsys.readouterr().err
    assert "usage: astream generate" in err
    assert "argument --device: 'cuda' was asked for but CUDA is not available; use --device cpu" in err


def test_serve_on_a_busy_port_fails_before_loading_the_model(capsys, monkeypatch):
    import socket

    import astream.engine.engine

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(astream.engine.engine.Engine, "__init__", no_loading)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port), "--device", "cpu"]) == 1
    assert f"port {port} on 127.0.0.1 is already in use" in capsys.readouterr().err


def test_serve_on_a_public_host_needs_a_key_or_consent(capsys, monkeypatch):
    monkeypatch.delenv("ASTREAM_API_KEY", raising=False)
    with pytest.raises(SystemExit) as refused:
        main(["serve", "--host", "0.0.0.0", "--device", "cpu"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "usage: astream serve" in err and "--allow-unauthenticated" in err
