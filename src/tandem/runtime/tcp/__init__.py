"""TCP request plane: length-prefixed msgpack frames over asyncio (see `frame.py`)."""

from tandem.runtime.tcp.client import ResponseStream, TcpRequestClient
from tandem.runtime.tcp.server import StreamContext, TcpRequestServer

__all__ = ["ResponseStream", "StreamContext", "TcpRequestClient", "TcpRequestServer"]
