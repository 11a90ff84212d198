"""The OpenAI HTTP API's requests as pydantic models, and its responses and stream chunks.
Pure: no sockets, no engine. docs/PROTOCOL.md lists what is supported.

Field names and defaults follow OpenAI's API reference (and vLLM's extensions `top_k`,
`min_tokens`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`). A field this server
does not know is accepted and ignored, with a warning in the log, as vLLM does; a field it
knows but cannot honour (`logit_bias`, `tools`, `echo`, ...) passes only at the value that
asks for nothing, and is otherwise a 400 naming it, never silently dropped.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from astream.base.sampling import SamplingParams
from astream.base.validation import is_unicode, short_repr
from astream.text.tokenization import Prompt

COMPLETIONS_DEFAULT_MAX_TOKENS = 16          # OpenAI's default for /v1/completions
MAX_LOGPROBS = 20                            # OpenAI's limit for top_logprobs
MAX_N = 16

Finite = Annotated[float, Field(allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


class ApiError(Exception):
    """A request answered with OpenAI's error object and an HTTP status."""

    def __init__(self, status: HTTPStatus, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                429: "rate_limit_error", 503: "service_unavailable"}.get(
                    self.status.value, "invalid_request_error")
        if self.status >= 500 and self.status != HTTPStatus.SERVICE_UNAVAILABLE:
            kind = "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}


# ---- requests ----------------------------------------------------------------------------

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")            # name, tool_call_id, ...: not used
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[_TextPart]

    def plain(self) -> dict:
        text = self.content if isinstance(self.content, str) else \
            "".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class _Common(BaseModel):
    """What both routes take."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: Finite | None = None
    top_p: Finite | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: Finite = 0.0
    frequency_penalty: Finite = 0.0
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # Extensions, as vLLM names them.
    top_k: int | None = None
    min_tokens: int = Field(0, ge=0)
    repetition_penalty: Finite = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None


class CompletionRequest(_Common):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: int | None = Field(None, ge=0, le=5)         # OpenAI's completions limit
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def the_prompt(self) -> Prompt:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(HTTPStatus.BAD_REQUEST, "send one prompt per request (a list of "
                               f"{len(prompt)} prompts was given)", "prompt")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(HTTPStatus.BAD_REQUEST, "prompt must not be empty", "prompt")
        if isinstance(prompt, str) and not is_unicode(prompt):
            raise ApiError(HTTPStatus.BAD_REQUEST, "prompt is not valid unicode", "prompt")
        return prompt


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("messages")
    @classmethod
    def _unicode(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        for message in messages:
            if not is_unicode(message.plain()["content"]):
                raise ValueError("message content is not valid unicode")
        return messages


# A field astream does not implement passes only at a value that asks for nothing.
_NEUTRAL = {"logit_bias": (None, {}), "echo": (False,), "suffix": (None, ""), "best_of": (None, 1),
            "tools": (None, []), "tool_choice": (None, "none", "auto"),
            "response_format": (None, {"type": "text"})}


@dataclass(slots=True, frozen=True)
class ApiRequest:
    chat: bool
    prompt: Prompt                                # text or token ids; chat: the messages
    params: SamplingParams
    stream: bool
    include_usage: bool
    model: str
    n: int
    logprobs: int | None                          # alternatives per token; None: none asked for
    ignored: tuple[str, ...]                      # unknown fields, ignored (the log says so)
    # max_tokens as the client asked (a prompt that cannot fit it gets a 400); None when it
    # was defaulted: generation then ends with "length" at the context's end, as in vLLM.
    asked_max_tokens: int | None


def parse_request(raw: bytes, chat: bool, served_model: str, max_tokens_cap: int) -> ApiRequest:
    body = _load(raw)
    try:
        request = (ChatRequest if chat else CompletionRequest).model_validate(body)
    except ValidationError as exc:
        raise _invalid(exc) from None
    for name, allowed in _NEUTRAL.items():
        value = getattr(request, name, None)
        if value is not None and not any(value == a for a in allowed):
            raise ApiError(HTTPStatus.BAD_REQUEST, f"{name}={short_repr(value)} is not supported "
                           "by astream; leave it out", name)
    model = request.model or served_model
    if model != served_model:
        raise ApiError(HTTPStatus.NOT_FOUND, f"the model {short_repr(model)} does not exist; "
                       f"this server serves {served_model!r}", "model", "model_not_found")
    if request.stream_options is not None and not request.stream:
        raise ApiError(HTTPStatus.BAD_REQUEST, "stream_options needs stream=true", "stream_options")
    prompt = [m.plain() for m in request.messages] if chat else request.the_prompt()
    logprobs = _logprobs(request)
    params = _params(request, chat, max_tokens_cap, logprobs)
    return ApiRequest(chat, prompt, params, request.stream,
                      bool(request.stream_options and request.stream_options.include_usage),
                      served_model, request.n, logprobs, tuple(sorted(request.model_extra or ())),
                      request.max_completion_tokens if chat and request.max_completion_tokens
                      is not None else request.max_tokens)


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


def _invalid(exc: ValidationError) -> ApiError:
    """The first problem pydantic found, in words a client can act on, naming the field."""
    error = exc.errors(include_url=False, include_input=False)[0]
    location = [str(part) for part in error["loc"]]
    # A union reports each alternative's failure under its type's name: keep the field.
    param = location[0] if location else None
    where = ".".join(location) or "body"
    return ApiError(HTTPStatus.BAD_REQUEST, f"{where}: {error['msg']}", param)


def _logprobs(request: _Common) -> int | None:
    if isinstance(request, ChatRequest):
        if request.top_logprobs is not None and not request.logprobs:
            raise ApiError(HTTPStatus.BAD_REQUEST, "top_logprobs needs logprobs=true", "top_logprobs")
        return (request.top_logprobs or 0) if request.logprobs else None
    return request.logprobs


def _params(request: _Common, chat: bool, cap: int, logprobs: int | None) -> SamplingParams:
    given = "max_completion_tokens" if chat and request.max_completion_tokens is not None \
        else "max_tokens"
    max_tokens = getattr(request, given)
    if max_tokens is None:
        max_tokens = cap if chat else min(COMPLETIONS_DEFAULT_MAX_TOKENS, cap)
    elif max_tokens > cap:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{given} {short_repr(max_tokens)} is above this "
                       f"server's cap of {cap}", given)
    values = {name: getattr(request, name) for name in ("temperature", "top_p", "top_k", "seed")
              if getattr(request, name) is not None}
    values.update(max_tokens=max_tokens, stop=request.stop or (), ignore_eos=request.ignore_eos,
                  stop_token_ids=tuple(request.stop_token_ids or ()),
                  presence_penalty=request.presence_penalty,
                  frequency_penalty=request.frequency_penalty,
                  repetition_penalty=request.repetition_penalty, min_tokens=request.min_tokens,
                  logprobs=logprobs, n=request.n)
    known = SamplingParams.__dataclass_fields__
    try:
        return SamplingParams(**{k: v for k, v in values.items() if k in known})
    except (TypeError, ValueError, OverflowError) as exc:
        message = str(exc)
        named = _first_named(message, values)
        raise ApiError(HTTPStatus.BAD_REQUEST, message,
                       given if named == "max_tokens" else named) from None


def _first_named(message: str, names) -> str | None:
    """The parameter a SamplingParams error is about: the first of `names` it mentions."""
    found = [(match.start(), name) for name in names
             if (match := re.search(rf"\b{name}\b", message.replace("strings", "")))]
    return min(found)[1] if found else None


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

    def whole(self, choices: list[dict], usage: dict) -> dict:
        """choices: from `choice` below, one per completion."""
        kind = "chat.completion" if self.request.chat else "text_completion"
        return {**self._object(kind, choices), "usage": usage}

    def choice(self, index: int, text: str, finish_reason: str, logprobs: dict | None) -> dict:
        if self.request.chat:
            return {"index": index, "message": {"role": "assistant", "content": text},
                    "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def chunk(self, index: int, text: str | None, finish_reason: str | None = None,
              first: bool = False, logprobs: dict | None = None) -> dict:
        """One stream chunk; chat's first carries the role, the last the finish reason. With
        include_usage every chunk has "usage": null, and `usage_chunk` ends the stream."""
        if self.request.chat:
            delta = {} if text is None else {"content": text}
            if first:
                delta = {"role": "assistant", **delta}
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs,
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


def models_list(served_model: str, created: int, max_model_len: int) -> dict:
    return {"object": "list", "data": [{"id": served_model, "object": "model", "created": created,
                                        "owned_by": "astream", "max_model_len": max_model_len}]}
