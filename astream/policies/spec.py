"""Policy names with parameters, as engine options and command lines give them.

    "quest"                                       -> [("quest", {})]
    "minference(vertical_size=4000, slash_size=24384)"
    "xattention(threshold=0.95)+quest(page_size=32)"

A spec is one or two parts joined by '+'; a part is a policy name with optional
parameters in parentheses: key=value pairs separated by commas, each value an integer, a
number, true/false or a word (quest(gqa_reduce=sum)). Which names and keys exist is checked where the policy is built.
"""

from __future__ import annotations

import re

_PART = re.compile(r"\s*([A-Za-z][\w-]*)\s*(?:\((.*)\))?\s*", re.DOTALL)
_KEY = re.compile(r"[A-Za-z_]\w*")


def split_top_level(text: str, separator: str) -> list[str]:
    """`text` split at `separator` where it is outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth < 0:
            break
        if ch == separator and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"{text!r}: unbalanced parentheses")
    parts.append(text[start:])
    return parts


def parse_policy_spec(spec: str) -> list[tuple[str, dict]]:
    """(name, parameters) of each '+'-joined part of a policy spec; ValueError names what
    cannot be read."""
    parsed = []
    for part in split_top_level(spec, "+"):
        match = _PART.fullmatch(part)
        if not match:
            raise ValueError(f"sparse_policy {spec!r}: cannot read {part.strip()!r}; write a policy "
                             "name, optionally with parameters, e.g. 'xattention(threshold=0.95)'")
        parsed.append((match[1], _parameters(spec, match[2])))
    return parsed


def _parameters(spec: str, text: str | None) -> dict:
    params: dict = {}
    if text is None or not text.strip():
        return params
    for item in text.split(","):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not _KEY.fullmatch(key) or not value:
            raise ValueError(f"sparse_policy {spec!r}: parameter {item.strip()!r} is not key=value")
        if key in params:
            raise ValueError(f"sparse_policy {spec!r}: parameter {key!r} is given twice")
        params[key] = _value(spec, key, value)
    return params


def _value(spec: str, key: str, text: str) -> int | float | bool | str:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        pass
    if _KEY.fullmatch(text):         # a word, e.g. quest(gqa_reduce=sum)
        return text
    raise ValueError(f"sparse_policy {spec!r}: {key}={text!r} is not a number, true/false or a word")
