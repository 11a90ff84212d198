"""ServerOptions: the server's own settings (engine settings live in EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(slots=True)
class ServerOptions:
    host: str = "127.0.0.1"                  # loopback unless told otherwise
    port: int = 8765                         # 0 picks a free port (see StreamServer.port)
    api_key: str | None = None               # when set, handshakes need "Authorization: Bearer KEY"
    allowed_origins: tuple[str, ...] = field(   # browser Origins let in when no api_key is set
        default=(), metadata={"flags": ("--allowed-origin",)})
    max_connections: int = 256               # open websocket connections at once
    max_requests_per_connection: int | None = None   # None: a quarter of max_num_seqs
    max_tokens_cap: int = 4096               # largest max_tokens a request may ask for
    max_frame_bytes: int = 2**20             # a larger client frame closes the connection (1009)
    shutdown_timeout: float = 30.0           # seconds in-flight requests get to finish on shutdown
    progress_interval: float = 2.0           # longest gap between progress frames during prefill
    log_level: str = "info"                  # debug | info (a line per finished request) | warning | error
    served_model_name: str | None = None     # the model id /v1/models reports; None: the model as given

    def __post_init__(self) -> None:
        self.allowed_origins = tuple(self.allowed_origins)
        for name in ("max_tokens_cap", "max_frame_bytes", "max_connections"):
            _check_positive(name, getattr(self, name))
        if self.max_requests_per_connection is not None:
            _check_positive("max_requests_per_connection", self.max_requests_per_connection)
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.progress_interval <= 0:
            raise ValueError(f"progress_interval must be > 0, got {self.progress_interval}")
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

    def requests_per_connection(self, max_num_seqs: int) -> int:
        """The per-connection request limit: as set, or a quarter of the engine's running slots,
        so no single connection can hold every slot."""
        if self.max_requests_per_connection is not None:
            return self.max_requests_per_connection
        return max(1, max_num_seqs // 4)


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
