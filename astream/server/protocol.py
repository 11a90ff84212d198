"""The astream-ws/1 wire protocol: client frames parsed and validated, server frames built.

Everything here is pure: no sockets, no engine. docs/PROTOCOL.md is the reference.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from astream.base.outputs import StreamToken
from astream.base.sampling import SamplingParams
from astream.base.validation import is_unicode, short_repr
from astream.text.tokenization import Prompt

PROTOCOL_VERSION = "astream-ws/1"
MAX_ID_CHARS = 256
MAX_JSON_DEPTH = 8             # the deepest valid frame nests 3 levels

# Stable error codes (docs/PROTOCOL.md lists when each is sent).
INVALID_JSON = "invalid_json"
BINARY_FRAME = "binary_frame"
UNKNOWN_TYPE = "unknown_type"
INVALID_FIELD = "invalid_field"
UNKNOWN_FIELD = "unknown_field"
UNKNOWN_PARAM = "unknown_param"
MAX_TOKENS_CAP = "max_tokens_cap"
PROMPT_TOO_LONG = "prompt_too_long"
INVALID_PROMPT = "invalid_prompt"
DUPLICATE_ID = "duplicate_id"
UNKNOWN_ID = "unknown_id"
TOO_MANY_REQUESTS = "too_many_requests"
SHUTTING_DOWN = "shutting_down"
ENGINE_ERROR = "engine_error"
INTERNAL = "internal"

_GENERATE_FIELDS = frozenset({"type", "id", "prompt", "messages", "params"})
_CANCEL_FIELDS = frozenset({"type", "id"})
_NUMBER = (int, float)
_DEFAULT_MAX_TOKENS = SamplingParams().max_tokens


class FrameError(Exception):
    """A client frame that cannot be served; becomes one error frame."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


@dataclass(slots=True, frozen=True)
class Generate:
    id: str
    prompt: Prompt
    params: SamplingParams
    # The client's own max_tokens: a prompt that cannot fit it is refused. A defaulted one
    # is not a promise, and ends with "length" at the context's end instead.
    asked_max_tokens: bool = True


@dataclass(slots=True, frozen=True)
class Cancel:
    id: str


def parse_frame(message: str | bytes, max_tokens_cap: int) -> Generate | Cancel:
    """One received websocket message -> a request; raises FrameError for anything invalid."""
    if not isinstance(message, str):
        raise FrameError(BINARY_FRAME, "binary frames are not part of the protocol; send JSON text")
    frame = _load_json(message)
    if not isinstance(frame, dict):
        raise FrameError(INVALID_FIELD, f"a frame must be a JSON object, got {_json_type(frame)}")
    kind = frame.get("type")
    if not isinstance(kind, str):
        raise FrameError(INVALID_FIELD, "field 'type' must be a string", _loose_id(frame))
    if kind == "generate":
        return _parse_generate(frame, max_tokens_cap)
    if kind == "cancel":
        request_id = _request_id(frame)
        _reject_unknown_fields(frame, _CANCEL_FIELDS, request_id)
        return Cancel(request_id)
    raise FrameError(UNKNOWN_TYPE, f"unknown frame type {short_repr(kind)}; expected 'generate' or "
                     "'cancel'", _loose_id(frame))


def _load_json(message: str) -> object:
    """Strict JSON: no NaN or Infinity, nesting at most MAX_JSON_DEPTH deep."""
    try:
        frame = json.loads(message, parse_constant=_no_constant)
    except RecursionError:
        raise FrameError(INVALID_JSON, f"frame nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:
        raise FrameError(INVALID_JSON, f"frame is not valid JSON: {str(exc)[:200]}") from None
    if _depth(frame) > MAX_JSON_DEPTH:
        raise FrameError(INVALID_JSON, f"frame nests deeper than {MAX_JSON_DEPTH} levels")
    return frame


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def _depth(value: object) -> int:
    """Nesting depth of parsed JSON, without recursion (arrays and objects count a level)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_JSON_DEPTH:
            return depth
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _parse_generate(frame: dict, max_tokens_cap: int) -> Generate:
    request_id = _request_id(frame)
    _reject_unknown_fields(frame, _GENERATE_FIELDS, request_id)
    has_prompt, has_messages = "prompt" in frame, "messages" in frame
    if has_prompt == has_messages:
        raise FrameError(INVALID_FIELD, "give exactly one of 'prompt' and 'messages'", request_id)
    prompt = _prompt(frame["prompt"], request_id) if has_prompt else \
        _messages(frame["messages"], request_id)
    params = frame.get("params", {})
    return Generate(request_id, prompt, _params(params, max_tokens_cap, request_id),
                    "max_tokens" in params)


def _request_id(frame: dict) -> str:
    value = frame.get("id")
    if not _is_id(value):
        raise FrameError(INVALID_FIELD, f"field 'id' must be a string of 1 to {MAX_ID_CHARS} "
                         "characters of valid unicode")
    return value


def _loose_id(frame: dict) -> str | None:
    """The frame's id for an error frame, when it is a usable one."""
    value = frame.get("id")
    return value if _is_id(value) else None


def _is_id(value: object) -> bool:
    # A lone surrogate cannot be written back in UTF-8: such an id could never be answered.
    return isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS and is_unicode(value)


def _reject_unknown_fields(frame: dict, known: frozenset, request_id: str) -> None:
    unknown = sorted(set(frame) - known)
    if unknown:
        raise FrameError(UNKNOWN_FIELD, f"unknown field(s) {short_repr(unknown)} in a {frame['type']!r} "
                         f"frame; known: {sorted(known)}", request_id)


def _prompt(value: object, request_id: str) -> Prompt:
    if isinstance(value, str) and value:
        _check_text(value, "prompt", request_id)
        return value
    if isinstance(value, list) and value and all(_is_int(t) and t >= 0 for t in value):
        return list(value)
    raise FrameError(INVALID_FIELD, "field 'prompt' must be a non-empty string or a non-empty list "
                     "of token ids", request_id)


def _messages(value: object, request_id: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise FrameError(INVALID_FIELD, "field 'messages' must be a non-empty list", request_id)
    for i, message in enumerate(value):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise FrameError(INVALID_FIELD, f"messages[{i}] must be an object with string 'role' "
                             "and 'content'", request_id)
        _check_text(message["role"], f"messages[{i}].role", request_id)
        _check_text(message["content"], f"messages[{i}].content", request_id)
    return list(value)


def _check_text(value: str, name: str, request_id: str) -> None:
    if not is_unicode(value):
        raise FrameError(INVALID_PROMPT, f"{name} is not valid unicode (it holds a lone surrogate)",
                         request_id)


def _params(value: object, max_tokens_cap: int, request_id: str) -> SamplingParams:
    if not isinstance(value, dict):
        raise FrameError(INVALID_FIELD, "field 'params' must be an object", request_id)
    known = {f.name for f in fields(SamplingParams)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise FrameError(UNKNOWN_PARAM, f"unknown param(s) {short_repr(unknown)}; known: "
                         f"{sorted(known)}", request_id)
    for name, item in value.items():
        _check_param_type(name, item, request_id)
    params = dict(value)
    max_tokens = params.setdefault("max_tokens", min(_DEFAULT_MAX_TOKENS, max_tokens_cap))
    if max_tokens > max_tokens_cap:
        raise FrameError(MAX_TOKENS_CAP, f"max_tokens {short_repr(max_tokens)} is above this server's "
                         f"cap of {max_tokens_cap}", request_id)
    try:
        sampling = SamplingParams.from_dict(params)
    except ValueError as exc:
        raise FrameError(INVALID_FIELD, f"params: {exc}", request_id) from None
    if sampling.n != 1:
        raise FrameError(INVALID_FIELD, "params.n must be 1: astream-ws/1 streams one completion "
                         "per request (send n requests, or use the OpenAI API's n)", request_id)
    return sampling


def _check_param_type(name: str, value: object, request_id: str) -> None:
    """JSON types per param; SamplingParams then checks ranges. New params pass through."""
    ok = {
        "temperature": lambda v: _is_number(v),
        "top_p": lambda v: _is_number(v),
        "top_k": _is_int,
        "max_tokens": _is_int,
        "seed": lambda v: v is None or _is_int(v),
        "stop": lambda v: isinstance(v, str) or (isinstance(v, list)
                                                 and all(isinstance(s, str) for s in v)),
        "stop_token_ids": lambda v: isinstance(v, list) and all(_is_int(t) for t in v),
        "ignore_eos": lambda v: isinstance(v, bool),
        "presence_penalty": _is_number,
        "frequency_penalty": _is_number,
        "repetition_penalty": _is_number,
        "min_tokens": _is_int,
        "logprobs": lambda v: v is None or _is_int(v),
        "n": _is_int,
    }.get(name, lambda v: True)
    if not ok(value):
        raise FrameError(INVALID_FIELD, f"params.{name} has the wrong type ({_json_type(value)})",
                         request_id)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, _NUMBER) and not isinstance(value, bool)


def _json_type(value: object) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number",
             float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


# ---- server frames -------------------------------------------------------------------

_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))   # built once: per token
_ESCAPED = json.JSONEncoder(separators=(",", ":"))


def encode(frame: dict) -> str:
    """A server frame (or any JSON payload) as compact JSON text that is always valid UTF-8
    when sent."""
    text = _COMPACT.encode(frame)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:               # a lone surrogate: escaped, it is still valid JSON
        text = _ESCAPED.encode(frame)
    return text


def token_frame(request_id: str, token: StreamToken) -> dict:
    """token_id is null for text released without a token (the final marker of an abort)."""
    frame = {"type": "token", "id": request_id, "index": token.index,
             "token_id": token.token_id if token.token_id >= 0 else None, "text": token.text}
    if token.logprob is not None:
        frame["logprob"] = token.logprob
        frame["top_logprobs"] = [list(pair) for pair in token.top_logprobs or ()]
    return frame


def progress_frame(request_id: str, prefilled: int, total: int) -> dict:
    return {"type": "progress", "id": request_id, "prefilled": prefilled, "total": total}


def done_frame(request_id: str, finish_reason: str, prompt_tokens: int, completion_tokens: int,
               timing: dict) -> dict:
    return {"type": "done", "id": request_id, "finish_reason": finish_reason,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
            "timing": {k: None if v is None else round(v, 3) for k, v in timing.items()}}


def error_frame(request_id: str | None, code: str, message: str) -> dict:
    return {"type": "error", "id": request_id, "code": code, "message": message}
