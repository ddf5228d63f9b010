"""Framed asyncio.Protocol base shared by the request-plane server and client connections."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any, cast

from tandem.runtime.tcp import frame as fr

logger = logging.getLogger(__name__)


class FrameTransport(asyncio.Protocol):
    """Parses frames in `data_received` and calls `on_frame` for each (no task per frame).
    `send` queues a frame; all frames queued in one loop iteration leave in one write.
    `write_paused` + `wait_writable` give writers backpressure from the kernel buffer."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.write_paused = False
        self._rbuf = bytearray()
        self._wbuf: list[bytes] = []
        self._writable: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wbuf.clear()
        self._wake_writers()

    def data_received(self, data: bytes) -> None:
        self._rbuf += data
        try:
            fr.decode_frames(self._rbuf, self.on_frame)
        except Exception:
            logger.exception("bad frame from %s; closing connection", self.peer)
            assert self.transport is not None
            self.transport.abort()

    @property
    def peer(self) -> str:
        info = self.transport.get_extra_info("peername") if self.transport else None
        return f"{info[0]}:{info[1]}" if info else "?"

    def on_frame(self, f: list[Any]) -> None:
        raise NotImplementedError

    def send(self, frame: tuple[Any, ...]) -> None:
        if self.closed:
            return
        if not self._wbuf:
            self.loop.call_soon(self._flush)
        self._wbuf.append(fr.encode(frame))

    def _flush(self) -> None:
        if self._wbuf and not self.closed and self.transport is not None:
            data = self._wbuf[0] if len(self._wbuf) == 1 else b"".join(self._wbuf)
            self.transport.write(data)
        self._wbuf.clear()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_writers()

    def _wake_writers(self) -> None:
        w, self._writable = self._writable, None
        if w is not None and not w.done():
            w.set_result(None)

    async def wait_writable(self) -> None:
        """Return once the transport's write buffer drained (or the connection closed)."""
        if not self.write_paused or self.closed:
            return
        if self._writable is None:
            self._writable = self.loop.create_future()
        await asyncio.shield(self._writable)
