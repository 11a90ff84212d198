"""Option values from a config file and from the environment, for the command line.

Every engine, sampling and server option of a command may also come from

- a file given with `--config FILE`: TOML (`.toml`), or YAML (`.yaml`/`.yml`, with PyYAML),
  one top-level table whose keys are the option names (`max_model_len` or
  `max-model-len`), e.g. `max_model_len = 8192`;
- an environment variable named ASTREAM_ and the option's name in capitals, e.g.
  `ASTREAM_MAX_MODEL_LEN=8192`. Booleans read 1/0, true/false, yes/no or on/off; a
  repeatable option takes one value or a JSON list (`ASTREAM_STOP='["\\n\\n", "END"]'`).

A flag on the command line wins over the file, the file over the environment, and the
environment over the built-in default.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

ENV_PREFIX = "ASTREAM_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_NATIVE = {int: (int,), float: (int, float), str: (str,)}
_KIND_NAMES = {int: "an integer", float: "a number", str: "a string"}


@dataclass(slots=True, frozen=True)
class OptionSpec:
    """One option as a file or variable may set it."""

    name: str                                   # the option's field name, e.g. max_model_len
    parse: Callable[[str], object] = str        # text to value, as the flag converts it
    boolean: bool = False
    repeated: bool = False                      # a list of values (a repeatable flag)


@dataclass(slots=True, frozen=True)
class Setting:
    value: object
    source: str                                 # where it came from, for error messages


def env_name(option: str) -> str:
    return ENV_PREFIX + option.upper()


def read_config_file(path: Path) -> dict[str, object]:
    """The file's top-level table, keys with '-' spelled '_'; ValueError saying what is wrong."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the config file {path}: {exc.strerror or exc}") from None
    suffix = path.suffix.lower()
    if suffix == ".toml":
        data = _parse_toml(text, path)
    elif suffix in (".yaml", ".yml"):
        data = _parse_yaml(text, path)
    else:
        raise ValueError(f"config file {path}: use a .toml, .yaml or .yml file")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path}: expected a table of option = value, got "
                         f"{type(data).__name__}")
    return {str(key).replace("-", "_"): value for key, value in data.items()}


def layered(options: Iterable[OptionSpec], given: Iterable[str], file: Mapping[str, object] | None,
            file_name: str, environ: Mapping[str, str]) -> dict[str, Setting]:
    """Values for the options not `given` on the command line: from the file, else from the
    environment. A key of the file that names no option raises ValueError naming it."""
    options = {option.name: option for option in options}
    file = file or {}
    unknown = sorted(set(file) - set(options))
    if unknown:
        close = difflib.get_close_matches(unknown[0], options, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; known options: {', '.join(sorted(options))}"
        raise ValueError(f"{file_name}: unknown option {unknown[0]!r}{hint}")
    given = set(given)
    out: dict[str, Setting] = {}
    for name, option in options.items():
        if name in given:
            continue
        if file.get(name) is not None:
            source = f"{file_name}: {name}"
            out[name] = Setting(_from_file(option, file[name], source), source)
        elif env_name(name) in environ:
            source = f"${env_name(name)}"
            out[name] = Setting(_from_text(option, environ[env_name(name)], source), source)
    return out


def _from_text(option: OptionSpec, text: str, source: str) -> object:
    if not text.strip():
        raise ValueError(f"{source} is set but empty; unset it or give a value")
    if option.boolean:
        word = text.strip().lower()
        if word not in _TRUE + _FALSE:
            raise ValueError(f"{source}: expected 1/0, true/false, yes/no or on/off, got {text!r}")
        return word in _TRUE
    if option.repeated:
        items = _json_list(text, source) if text.lstrip().startswith("[") else [text]
        return [_item(option, item, source) for item in items]
    return _parse(option, text, source)


def _from_file(option: OptionSpec, value: object, source: str) -> object:
    if option.boolean:
        if not isinstance(value, bool):
            raise ValueError(f"{source}: expected true or false, got {value!r}")
        return value
    if option.repeated:
        return [_item(option, item, source) for item in (value if isinstance(value, list) else [value])]
    return _item(option, value, source)


def _item(option: OptionSpec, value: object, source: str) -> object:
    native = _NATIVE.get(option.parse)
    if native and isinstance(value, native) and not isinstance(value, bool):
        return option.parse(value)
    if isinstance(value, str):
        return _parse(option, value, source)
    expected = _KIND_NAMES.get(option.parse, "a string")
    raise ValueError(f"{source}: expected {expected}, got {value!r}")


def _parse(option: OptionSpec, text: str, source: str) -> object:
    try:
        return option.parse(text)
    except ValueError:
        expected = _KIND_NAMES.get(option.parse, "a valid value")
        raise ValueError(f"{source}: expected {expected}, got {text!r}") from None


def _json_list(text: str, source: str) -> list:
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: not a JSON list ({exc.msg})") from None
    if not isinstance(items, list):
        raise ValueError(f"{source}: expected a JSON list, got {text!r}")
    return items


def _parse_toml(text: str, path: Path) -> object:
    try:
        import tomllib
    except ImportError:                         # Python 3.10
        import tomli as tomllib
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {path} is not valid TOML: {exc}") from None


def _parse_yaml(text: str, path: Path) -> object:
    try:
        import yaml
    except ImportError:
        raise ValueError(f"config file {path}: reading YAML needs PyYAML (pip install pyyaml); "
                         "or write the file as TOML") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"config file {path} is not valid YAML: {exc}") from None
