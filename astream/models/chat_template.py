"""Chat templates rendered with jinja2 the way transformers' `apply_chat_template` renders
them, so that a prompt is byte for byte the one the model was trained on.

Templates come with model files, so they run in jinja2's immutable sandbox. The
environment has what Hugging Face templates expect: trim_blocks and lstrip_blocks, loop
controls, a `tojson` that keeps non-ASCII text and HTML characters as they are,
`raise_exception`, `strftime_now`, and the `{% generation %}` block (rendered as its body).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks."""

    tags = {"generation"}

    def parse(self, parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compiled(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def _message(message: dict) -> dict:
    """As transformers hands a message over: keys whose value is None dropped (templates test
    for a key, not for None), and reasoning offered under each of its usual names."""
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[k] for k in _REASONING_KEYS if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def render_chat(template: str, messages: list[dict], *, add_generation_prompt: bool = False,
                tools: list[dict] | None = None, documents: list[dict] | None = None,
                **variables: Any) -> str:
    """The prompt `template` makes of `messages`; `variables` (special tokens, template
    options such as enable_thinking) are visible to the template by name."""
    if not messages:
        raise ValueError("cannot apply a chat template to an empty conversation")
    return _compiled(template).render(messages=[_message(m) for m in messages], tools=tools,
                                      documents=documents,
                                      add_generation_prompt=add_generation_prompt, **variables)
