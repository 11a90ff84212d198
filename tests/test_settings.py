"""Options from --config files and ASTREAM_* variables: a flag wins over the file, the file over
the environment, the environment over the default (astream/face/settings.py, cli.parse_command)."""

from __future__ import annotations

import pytest

from astream.base.sampling import SamplingParams
from astream.face.cli import parse_command

DEFAULTS = SamplingParams()


def _generate(tmp_path, file_text: str | None, env: dict, *flags: str, suffix: str = ".toml"):
    argv = ["generate", *flags, "hi"]
    if file_text is not None:
        path = tmp_path / f"options{suffix}"
        path.write_text(file_text)
        argv[1:1] = ["--config", str(path)]
    _, (engine, params) = parse_command(argv, env)
    return engine, params


def test_flag_beats_file_beats_environment_beats_default(tmp_path):
    file = "max_tokens = 20\ntemperature = 0.5\nmax-model-len = 1024\n"
    env = {"ASTREAM_MAX_TOKENS": "30", "ASTREAM_TEMPERATURE": "0.25", "ASTREAM_TOP_K": "7",
           "ASTREAM_MAX_MODEL_LEN": "4096", "ASTREAM_DEVICE": "cpu"}
    engine, params = _generate(tmp_path, file, env, "--max-tokens", "10")
    assert params.max_tokens == 10                       # flag over file and environment
    assert params.temperature == 0.5                     # file over environment
    assert params.top_k == 7                             # environment over default
    assert params.top_p == DEFAULTS.top_p                # default
    assert engine["max_model_len"] == 1024 and engine["device"] == "cpu"
    assert "num_kv_blocks" not in engine                 # unset stays unset: EngineConfig decides


def test_environment_alone_and_nothing_at_all(tmp_path):
    engine, params = _generate(tmp_path, None, {"ASTREAM_MAX_TOKENS": "30"})
    assert params.max_tokens == 30
    engine, params = _generate(tmp_path, None, {})
    assert params == DEFAULTS and engine == {}


def test_yaml_file_with_lists_and_booleans(tmp_path):
    pytest.importorskip("yaml")
    file = 'stop: ["\\n\\n", END]\nignore-eos: true\nenable_prefix_caching: false\n'
    engine, params = _generate(tmp_path, file, {"ASTREAM_STOP": '["never"]'}, suffix=".yaml")
    assert params.stop == ("\n\n", "END") and params.ignore_eos is True
    assert engine["enable_prefix_caching"] is False


def test_environment_booleans_and_lists(tmp_path):
    env = {"ASTREAM_IGNORE_EOS": "yes", "ASTREAM_STOP_TOKEN_IDS": "[1, 2]", "ASTREAM_STOP": "END",
           "ASTREAM_OFFLOAD": "0"}
    engine, params = _generate(tmp_path, None, env)
    assert params.ignore_eos is True and params.stop_token_ids == (1, 2) and params.stop == ("END",)
    assert engine["offload"] is False


def test_server_options_and_the_api_key_come_from_the_environment(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text("port = 9001\nmax_num_seqs = 8\n")
    _, (engine, options) = parse_command(["serve", "--config", str(path)],
                                         {"ASTREAM_API_KEY": "secret", "ASTREAM_PORT": "9000"})
    assert (options.api_key, options.port, engine["max_num_seqs"]) == ("secret", 9001, 8)
    _, (_, options) = parse_command(["serve", "--api-key", "flag"], {"ASTREAM_API_KEY": "secret"})
    assert options.api_key == "flag"


@pytest.mark.parametrize("file_text, env, message", [
    ("max_tokenz = 3\n", {}, "options.toml: unknown option 'max_tokenz'; did you mean 'max_tokens'?"),
    ("colour = 'red'\n", {}, "options.toml: unknown option 'colour'; known options: "),
    ("max_tokens = 'many'\n", {}, "options.toml: max_tokens: expected an integer, got 'many'"),
    ("max_tokens = 0\n", {}, "options.toml: max_tokens: must be an integer >= 1"),
    ("max_tokens = [\n", {}, "is not valid TOML"),
    (None, {"ASTREAM_API_KEY": ""}, "$ASTREAM_API_KEY is set but empty"),
])
def test_bad_settings_are_named(tmp_path, capsys, file_text, env, message):
    argv = ["serve"] if "API_KEY" in str(env) else ["generate", "hi"]
    if file_text is not None:
        (tmp_path / "options.toml").write_text(file_text)
        argv[1:1] = ["--config", str(tmp_path / "options.toml")]
    with pytest.raises(SystemExit) as exit_:
        parse_command(argv, env)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: astream {argv[0]}")
    assert message in err


def test_a_file_key_of_another_command_is_refused(tmp_path, capsys):
    (tmp_path / "serve.toml").write_text("temperature = 0.5\n")
    with pytest.raises(SystemExit):
        parse_command(["serve", "--config", str(tmp_path / "serve.toml")], {})
    assert "unknown option 'temperature'" in capsys.readouterr().err
