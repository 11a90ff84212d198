"""ServerOptions: the websocket server's own settings (engine settings live in EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ServerOptions:
    host: str = "127.0.0.1"                  # loopback unless told otherwise
    port: int = 8765                         # 0 picks a free port (see StreamServer.port)
    api_key: str | None = None               # when set, handshakes need "Authorization: Bearer KEY"
    max_tokens_cap: int = 4096               # largest max_tokens a request may ask for
    max_frame_bytes: int = 2**20             # a larger client frame closes the connection (1009)
    max_requests_per_connection: int = 64    # live requests one connection may hold
    shutdown_timeout: float = 30.0           # seconds in-flight requests get to finish on shutdown
    progress_interval: float = 2.0           # longest gap between progress frames during prefill

    def __post_init__(self) -> None:
        for name in ("max_tokens_cap", "max_frame_bytes", "max_requests_per_connection"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.progress_interval <= 0:
            raise ValueError(f"progress_interval must be > 0, got {self.progress_interval}")
        if self.api_key == "":
            raise ValueError("api_key must not be empty; leave it unset to disable auth")
