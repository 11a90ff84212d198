"""The OpenAI HTTP API's requests parsed and checked, and its responses and stream chunks
built. Pure: no sockets, no engine. docs/PROTOCOL.md lists what is supported.

Fields OpenAI defines but astream cannot honour are accepted only at their neutral value
(n=1, no logprobs, no penalties, no tools, ...); any other value is a 400 naming the field,
never silently ignored. An unknown field is a 400 too. `top_k`, `ignore_eos` and
`stop_token_ids` are extensions, as in other engines.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus

from astream.sampling import SamplingParams
from astream.tokenization import Prompt
from astream.validation import is_unicode, short_repr

COMPLETIONS_DEFAULT_MAX_TOKENS = 16          # OpenAI's default for /v1/completions
_SAMPLING = ("temperature", "top_p", "top_k", "seed", "ignore_eos", "stop_token_ids")
_COMMON = frozenset({"model", "stream", "stream_options", "max_tokens", "stop", "n", "user",
                     "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", *_SAMPLING})
_COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format",
                          "tools", "tool_choice", "parallel_tool_calls"}
# A field astream does not implement passes only at a value that asks for nothing.
_NEUTRAL = {"n": (None, 1), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
            "logit_bias": (None, {}), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
            "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1), "tools": (None, []),
            "tool_choice": (None, "none", "auto"), "response_format": (None, {"type": "text"})}
_ROLES = ("system", "developer", "user", "assistant")


class ApiError(Exception):
    """A request answered with OpenAI's error object and an HTTP status."""

    def __init__(self, status: HTTPStatus, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error",
                503: "service_unavailable"}.get(self.status.value, "invalid_request_error")
        if self.status >= 500 and self.status != HTTPStatus.SERVICE_UNAVAILABLE:
            kind = "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}


@dataclass(slots=True, frozen=True)
class ApiRequest:
    chat: bool
    prompt: Prompt                                # text or token ids; chat: the messages
    params: SamplingParams
    stream: bool
    include_usage: bool
    model: str


def parse_request(raw: bytes, chat: bool, served_model: str, max_tokens_cap: int) -> ApiRequest:
    body = _load(raw)
    known = _CHAT_FIELDS if chat else _COMPLETION_FIELDS
    unknown = sorted(set(body) - known)
    if unknown:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"unrecognized request argument(s): "
                       f"{short_repr(unknown)}", unknown[0])
    for name, allowed in _NEUTRAL.items():
        if name in body and not any(type(body[name]) is type(a) and body[name] == a
                                    for a in allowed):
            raise ApiError(HTTPStatus.BAD_REQUEST, f"{name}={short_repr(body[name])} is not "
                           f"supported by astream; leave it out", name)
    model = body.get("model", served_model)
    if model != served_model:
        raise ApiError(HTTPStatus.NOT_FOUND, f"the model {short_repr(model)} does not exist; "
                       f"this server serves {served_model!r}", "model", "model_not_found")
    prompt = _messages(body.get("messages")) if chat else _prompt(body.get("prompt"))
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not (stream and isinstance(options, dict)
                                    and set(options) <= {"include_usage"}):
        raise ApiError(HTTPStatus.BAD_REQUEST, "stream_options needs stream=true and takes only "
                       "include_usage", "stream_options")
    include_usage = _flag(options or {}, "include_usage")
    params = _params(body, chat, max_tokens_cap)
    return ApiRequest(chat, prompt, params, stream, include_usage, served_model)


def _load(raw: bytes) -> dict:
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"the body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise ApiError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
    return body


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{name} must be a boolean", name)
    return value


def _prompt(value: object) -> Prompt:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]                           # a batch of one
    if isinstance(value, str) and value and is_unicode(value):
        return value
    if isinstance(value, list) and value and all(_is_int(t) and t >= 0 for t in value):
        return list(value)
    raise ApiError(HTTPStatus.BAD_REQUEST, "prompt must be a non-empty string or list of token "
                   "ids (one prompt per request)", "prompt")


def _messages(value: object) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ApiError(HTTPStatus.BAD_REQUEST, "messages must be a non-empty list", "messages")
    messages = []
    for i, message in enumerate(value):
        role = message.get("role") if isinstance(message, dict) else None
        content = _content(message.get("content")) if role in _ROLES else None
        if content is None:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"messages[{i}] needs a role among {_ROLES} and "
                           "text content (a string or a list of text parts)", "messages")
        messages.append({"role": "system" if role == "developer" else role, "content": content})
    return messages


def _content(value: object) -> str | None:
    if isinstance(value, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                       and isinstance(part.get("text"), str) for part in value):
        value = "".join(part["text"] for part in value)
    return value if isinstance(value, str) and is_unicode(value) else None


def _params(body: dict, chat: bool, cap: int) -> SamplingParams:
    values = {name: body[name] for name in _SAMPLING if body.get(name) is not None}
    for name in ("temperature", "top_p"):
        if name in values and not (_is_number(values[name]) and math.isfinite(values[name])):
            raise ApiError(HTTPStatus.BAD_REQUEST, f"{name} must be a number", name)
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    given = next((name for name in names if body.get(name) is not None), None)
    max_tokens = body[given] if given else (cap if chat else min(COMPLETIONS_DEFAULT_MAX_TOKENS, cap))
    if given and _is_int(max_tokens) and max_tokens > cap:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{given} {max_tokens} is above this server's cap "
                       f"of {cap}", given)
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list) and
                                                          all(isinstance(s, str) for s in stop))):
        raise ApiError(HTTPStatus.BAD_REQUEST, "stop must be a string or a list of strings", "stop")
    try:
        return SamplingParams(**values, max_tokens=max_tokens, stop=stop or ())
    except (TypeError, ValueError) as exc:
        raise ApiError(HTTPStatus.BAD_REQUEST, str(exc), _param_named(str(exc), given)) from None


def _param_named(message: str, max_tokens_field: str | None) -> str | None:
    name = message.split(" ", 1)[0]
    return (max_tokens_field or "max_tokens") if name == "max_tokens" else name


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ---- responses ---------------------------------------------------------------------------

@dataclass(slots=True)
class ResponseShape:
    """The fields every object of one response shares."""

    request: ApiRequest
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = f"{'chatcmpl' if self.request.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _object(self, kind: str, choices: list) -> dict:
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.request.model, "choices": choices}

    def whole(self, text: str, finish_reason: str, usage: dict) -> dict:
        if self.request.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish_reason}
            return {**self._object("chat.completion", [choice]), "usage": usage}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._object("text_completion", [choice]), "usage": usage}

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False) -> dict:
        """One stream chunk; chat's first carries the role, the last the finish reason. With
        include_usage every chunk has "usage": null, and `usage_chunk` ends the stream."""
        if self.request.chat:
            delta = {} if text is None else {"content": text}
            if first:
                delta = {"role": "assistant", **delta}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None,
                      "finish_reason": finish_reason}
        chunk = self._object(self._chunk_kind, [choice])
        return {**chunk, "usage": None} if self.request.include_usage else chunk

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._object(self._chunk_kind, []), "usage": usage}

    @property
    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.request.chat else "text_completion"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def models_list(served_model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": served_model, "object": "model", "created": created,
                                        "owned_by": "astream"}]}
