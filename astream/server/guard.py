"""Who may use the server: the checks every websocket handshake and every HTTP route makes
from the request's headers alone, before a body is read or a websocket opens, and the
client identity that fairness is kept by.

- Two Authorization or two Origin headers: 400 (which one would count is ambiguous).
- With an API key: 401 unless `Authorization: Bearer KEY` carries it exactly. The key is
  then the only guard; Origin is not checked.
- Without a key: a request carrying a browser Origin not listed in --allowed-origin gets
  403, so a web page a user opens cannot reach a server on their machine.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from http import HTTPStatus

from starlette.datastructures import Headers

from astream.server.options import ServerOptions

BEARER_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="astream"'}


@dataclass(slots=True, frozen=True)
class Refusal:
    status: HTTPStatus
    message: str
    code: str | None = None                     # OpenAI's error code, where it has one

    @property
    def headers(self) -> dict[str, str]:
        return BEARER_CHALLENGE if self.status == HTTPStatus.UNAUTHORIZED else {}


def refusal(headers: Headers, options: ServerOptions, *, check_origin: bool = True) -> Refusal | None:
    """Why this request may not proceed, or None. `check_origin` False: a route any page may
    read (the key, when set, still guards it)."""
    authorization, origins = headers.getlist("authorization"), headers.getlist("origin")
    if len(authorization) > 1 or len(origins) > 1:
        return Refusal(HTTPStatus.BAD_REQUEST, "send at most one Authorization and one Origin header")
    if options.api_key is not None:
        if len(authorization) == 1 and authorized(authorization[0], options.api_key):
            return None
        return Refusal(HTTPStatus.UNAUTHORIZED, "missing or wrong API key: send "
                       "'Authorization: Bearer KEY'", "invalid_api_key")
    if check_origin and origins and origins[0] not in options.allowed_origins:
        return Refusal(HTTPStatus.FORBIDDEN, "requests from this Origin are not allowed (see "
                       "--allowed-origin)")
    return None


def authorized(header: str | None, api_key: str) -> bool:
    scheme, _, token = (header or "").partition(" ")
    # compare_digest: the time taken must not reveal how much of the key matched.
    offered = token.strip().encode("utf-8", "surrogateescape")
    return scheme.lower() == "bearer" and hmac.compare_digest(offered, api_key.encode())


def http_client(peer: tuple[str, int] | None) -> str:
    """The fair scheduler's client for an HTTP request: its peer's address, so one machine's
    many connections and requests share one fair part of the running slots."""
    return f"http:{peer[0] if peer else 'unknown'}"
