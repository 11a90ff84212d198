"""What every connection of one server shares: the engine, the settings, the live counts."""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio

from astream.base.errors import EngineClosedError
from astream.base.outputs import Progress, StreamToken
from astream.engine.engine import Engine
from astream.engine.request_stream import RequestStream
from astream.server.options import ServerOptions
from astream.server.protocol import PROTOCOL_VERSION


@dataclass(slots=True)
class ServerState:
    engine: Engine
    options: ServerOptions
    requests_per_connection: int
    closing: bool = False                     # draining: no new requests
    connections: int = 0                      # open websocket connections
    live_requests: int = 0
    idle: anyio.Event = field(default_factory=anyio.Event)    # set while no request is live

    def __post_init__(self) -> None:
        self.idle.set()

    @property
    def max_model_len(self) -> int:
        return self.engine.stats()["max_model_len"]        # as the engine resolved it

    def request_started(self) -> None:
        self.live_requests += 1
        if self.idle.is_set():
            self.idle = anyio.Event()

    def request_ended(self) -> None:
        self.live_requests -= 1
        if self.live_requests == 0:
            self.idle.set()

    def context_overflow(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a prompt with this max_tokens does not fit the context, or None. Both
        protocols refuse such a request rather than cut its output short."""
        limit = self.max_model_len
        if prompt_tokens + max_tokens <= limit:
            return None
        return (f"this model's maximum context length is {limit} tokens, but {prompt_tokens + max_tokens} "
                f"were asked for ({prompt_tokens} in the prompt, {max_tokens} to generate); shorten "
                "the prompt or lower max_tokens")

    def health(self) -> dict:
        try:
            stats = self.engine.stats()
            status = ("engine_stopped" if not self.engine.running
                      else "shutting_down" if self.closing else "ok")
        except EngineClosedError:
            stats, status = {}, "engine_stopped"
        return {"status": status, "protocol": PROTOCOL_VERSION, "connections": self.connections,
                "live_requests": self.live_requests, **stats}


async def admitted(stream: RequestStream) -> StreamToken | Progress:
    """A new request's first item: the engine emits one as soon as it has tokenized and
    admitted the prompt (or a token that ends it: aborted, failed). Raises the ValueError
    of a prompt the engine refused."""
    return await stream.__anext__()
