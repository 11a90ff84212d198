"""ServerOptions: the server's own settings (engine settings live in EngineConfig).

Every limit the HTTP and websocket layers enforce is set here explicitly and handed to
uvicorn (astream/server/listen.py), so no limit is left at a library default that could
change under us.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

LOG_LEVELS = ("debug", "info", "warning", "error")


def _help(text: str, **metadata) -> dict:
    return {"help": text, **metadata}


@dataclass(slots=True)
class ServerOptions:
    host: str = field(default="127.0.0.1", metadata=_help(
        "address to listen on; 127.0.0.1 (loopback) keeps the server private to this machine, "
        "0.0.0.0 or :: opens it to the network and then needs --api-key (or "
        "--allow-unauthenticated)"))
    port: int = field(default=8765, metadata=_help("TCP port for every route; 0 picks a free one"))
    api_key: str | None = field(default=None, metadata=_help(
        "require 'Authorization: Bearer KEY' on websocket handshakes, /v1 and /metrics"))
    allow_unauthenticated: bool = field(default=False, metadata=_help(
        "serve on a non-loopback --host without an API key (anyone who can reach the port "
        "can use the model)"))
    allowed_origins: tuple[str, ...] = field(default=(), metadata=_help(
        "a browser Origin let in when no API key is set (repeat for several)",
        flags=("--allowed-origin",)))
    max_connections: int = field(default=256, metadata=_help(
        "open websocket connections at once; a handshake beyond it gets HTTP 503"))
    max_http_requests: int = field(default=256, metadata=_help(
        "OpenAI API requests running at once; one beyond it gets HTTP 429"))
    max_requests_per_connection: int | None = field(default=None, metadata=_help(
        "live requests on one websocket connection (default: a quarter of max_num_seqs)"))
    max_tokens_cap: int = field(default=4096, metadata=_help(
        "the largest max_tokens a request may ask for; above it a request is refused"))
    max_frame_bytes: int = field(default=2**20, metadata=_help(
        "the largest websocket frame (larger closes the connection with 1009) and the largest "
        "HTTP request body (larger gets 413)"))
    shutdown_timeout: float = field(default=30.0, metadata=_help(
        "seconds in-flight requests get to finish on SIGTERM before they are aborted"))
    progress_interval: float = field(default=2.0, metadata=_help(
        "longest gap, in seconds, between prefill progress reports (websocket progress "
        "frames, SSE comments) before a request's first token"))
    request_timeout: float = field(default=30.0, metadata=_help(
        "seconds a client has to send a request's head and body; a slower one is dropped"))
    keep_alive_timeout: float = field(default=30.0, metadata=_help(
        "seconds an idle HTTP keep-alive connection stays open"))
    ping_interval: float = field(default=20.0, metadata=_help(
        "seconds between the server's websocket pings"))
    ping_timeout: float = field(default=20.0, metadata=_help(
        "seconds a websocket peer has to answer a ping before it is dropped"))
    engine_process: bool = field(default=True, metadata=_help(
        "run the engine in a process of its own, so HTTP and websocket work never delays a "
        "decode step; --no-engine-process runs it on the server's event loop, in one process"))
    log_level: str = field(default="info", metadata=_help(
        "debug | info (a line per finished request) | warning | error"))
    served_model_name: str | None = field(default=None, metadata=_help(
        "the model id /v1/models reports and requests must name (default: the model as given)"))

    def __post_init__(self) -> None:
        self.allowed_origins = tuple(self.allowed_origins)
        for name in ("max_tokens_cap", "max_frame_bytes", "max_connections", "max_http_requests"):
            _check_positive(name, getattr(self, name))
        if self.max_requests_per_connection is not None:
            _check_positive("max_requests_per_connection", self.max_requests_per_connection)
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        if not isinstance(self.host, str) or not self.host.strip() or not self.host.isprintable():
            raise ValueError(f"host must be an address or a host name, got {self.host!r}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        for name in ("progress_interval", "request_timeout", "keep_alive_timeout",
                     "ping_interval", "ping_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.api_key is not None and (not self.api_key or not self.api_key.isprintable()
                                         or any(c.isspace() for c in self.api_key)):
            raise ValueError("api_key must be non-empty printable text without spaces; leave it "
                             "unset to disable auth")
        if self.served_model_name is not None and not (self.served_model_name.strip()
                                                       and self.served_model_name.isprintable()):
            raise ValueError(f"served_model_name must be non-empty printable text, got "
                             f"{self.served_model_name!r}")
        for origin in self.allowed_origins:
            if not origin or not origin.isprintable():
                raise ValueError(f"allowed origins must be non-empty printable text, got {origin!r}")
        if self.api_key is None and not self.allow_unauthenticated and not is_loopback(self.host):
            raise ValueError(f"host {self.host} is reachable from other machines, and no API key "
                             "is set: set one (--api-key, or $ASTREAM_API_KEY), or pass "
                             "--allow-unauthenticated to serve anyone who can reach the port")

    def requests_per_connection(self, max_num_seqs: int) -> int:
        """The per-connection request limit: as set, or a quarter of the engine's running slots,
        so no single connection can hold every slot."""
        if self.max_requests_per_connection is not None:
            return self.max_requests_per_connection
        return max(1, max_num_seqs // 4)


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach `host` (an address, or the name localhost)."""
    if host.strip("[]").lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False                           # a host name: it may resolve to anything


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
