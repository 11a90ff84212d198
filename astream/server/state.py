"""What every connection of one server shares: the engine, the settings, the live counts."""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio

from astream.engine import Engine
from astream.errors import EngineClosedError
from astream.server.options import ServerOptions
from astream.server.protocol import PROTOCOL_VERSION


@dataclass(slots=True)
class ServerState:
    engine: Engine
    options: ServerOptions
    requests_per_connection: int
    closing: bool = False                     # draining: no new requests
    connections: int = 0
    live_requests: int = 0
    idle: anyio.Event = field(default_factory=anyio.Event)    # set while no request is live

    def __post_init__(self) -> None:
        self.idle.set()

    def request_started(self) -> None:
        self.live_requests += 1
        if self.idle.is_set():
            self.idle = anyio.Event()

    def request_ended(self) -> None:
        self.live_requests -= 1
        if self.live_requests == 0:
            self.idle.set()

    def health(self) -> dict:
        try:
            stats = self.engine.stats()
            status = ("engine_stopped" if not self.engine.running
                      else "shutting_down" if self.closing else "ok")
        except EngineClosedError:
            stats, status = {}, "engine_stopped"
        return {"status": status, "protocol": PROTOCOL_VERSION, "connections": self.connections,
                "live_requests": self.live_requests, **stats}
