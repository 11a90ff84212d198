"""The websocket server: protocol astream-ws/1 (docs/PROTOCOL.md) in front of one Engine."""

from astream.server.app import StreamServer
from astream.server.options import ServerOptions
from astream.server.protocol import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION", "ServerOptions", "StreamServer"]
