"""Framed asyncio.Protocol base shared by the request-plane server and client connections."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any, cast

import msgpack

from tandem.runtime.tcp import frame as fr

logger = logging.getLogger(__name__)

# TCP keepalive on every request-plane socket: a peer whose host vanished (link down, power
# off) sends no RST, and an idle connection to it would otherwise look open for hours. After
# KEEPIDLE s without traffic the kernel probes every KEEPINTVL s and resets the connection after
# KEEPCNT unanswered probes: ~8 s. A frozen process (SIGSTOP) still answers these (its kernel
# does), which is what the client's PING covers (client.py).
KEEPIDLE_S, KEEPINTVL_S, KEEPCNT = 5, 1, 3


def set_keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPIDLE_S),
        ("TCP_KEEPINTVL", KEEPINTVL_S),
        ("TCP_KEEPCNT", KEEPCNT),
    ):
        option = getattr(socket, name, None)  # Linux has all three; macOS lacks TCP_KEEPIDLE
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


class FrameTransport(asyncio.Protocol):
    """Parses frames in `data_received` and calls `on_frame` for each (no task per frame).
    `send` queues a frame; all frames queued in one loop iteration leave in one write.
    `send_data`/`send_end` put a stream's DATA/END into one BATCH frame per iteration once the
    peer takes them (`takes_batches`), else send them as their own frames.
    `write_paused` + `wait_writable` give writers backpressure from the kernel buffer.

    A frame longer than `max_frame_bytes` (checked from its length prefix, before its body is
    read) or one `on_frame` rejects with FrameError closes the connection with a logged reason.
    Until the handshake is done the limit is `HANDSHAKE_MAX_FRAME_BYTES`."""

    def __init__(self, max_frame_bytes: int = fr.DEFAULT_MAX_FRAME_BYTES) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.max_frame_bytes = fr.HANDSHAKE_MAX_FRAME_BYTES
        self.session_max_frame_bytes = max_frame_bytes  # the limit once authenticated
        self.write_paused = False
        self.takes_batches = False  # the peer asked for BATCH frames (server side)
        self._rbuf = bytearray()
        self._wbuf: list[bytes] = []
        self._batch: list[Any] = []  # [BATCH, sid, payload | None, ...] not yet encoded
        self._batch_bytes = 0  # its payloads and a bound on each pair's msgpack overhead
        # a BATCH stays within this side's frame limit (the peer is configured alike): at most
        # half of it before the payload that closes it, each batched payload under a quarter
        self._batch_budget = min(fr.BATCH_MAX_BYTES, max_frame_bytes // 2)
        self._batch_payload_max = min(fr.BATCH_MAX_PAYLOAD_BYTES, max_frame_bytes // 4)
        self._writable: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_keepalive(sock)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wbuf.clear()
        self._batch.clear()
        self._wake_writers()

    def data_received(self, data: bytes) -> None:
        buf = self._rbuf
        buf += data
        off, n = 0, len(buf)
        unpack_from, unpackb, on_frame = fr.HEADER.unpack_from, msgpack.unpackb, self.on_frame
        try:
            while n - off >= 4 and not self.closed:
                (size,) = unpack_from(buf, off)
                if size > self.max_frame_bytes:  # re-read: it grows once authenticated
                    raise fr.FrameError(
                        f"frame of {size} bytes exceeds max_frame_bytes={self.max_frame_bytes}"
                    )
                end = off + 4 + size
                if end > n:
                    break
                # a body that is not a [kind, ...] array fails in on_frame: connection dropped
                frame = unpackb(buf[off + 4 : end], raw=False, use_list=True)
                off = end
                on_frame(frame)
        except fr.FrameError as exc:
            self.drop(str(exc))
        except Exception as exc:
            logger.warning("bad frame from %s", self.peer, exc_info=True)
            self.drop(f"bad frame: {type(exc).__name__}: {exc}")
        finally:
            if off and not self.closed:
                del buf[:off]

    def drop(self, reason: str) -> None:
        """Close the connection at once (unsent frames are lost), logging why."""
        logger.warning("closing request-plane connection with %s: %s", self.peer, reason)
        self.closed = True
        self._rbuf.clear()
        if self.transport is not None:
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
        if self._batch:  # it goes first: order holds across frame kinds
            self._seal()
        elif not self._wbuf:
            self.loop.call_soon(self._flush)
        self._wbuf.append(fr.encode(frame))

    def send_data(self, sid: int, payload: bytes) -> None:
        """One DATA of stream `sid`: into this iteration's BATCH where the peer takes them."""
        if not self.takes_batches or len(payload) > self._batch_payload_max:
            self.send((fr.DATA, sid, payload))
        else:
            self._add(sid, payload)

    def send_end(self, sid: int) -> None:
        """The END of stream `sid` (after its DATA, in the same BATCH where batching)."""
        if not self.takes_batches:
            self.send((fr.END, sid))
        else:
            self._add(sid, None)

    def _add(self, sid: int, payload: bytes | None) -> None:
        """One pair into this iteration's BATCH; sealed once past its byte budget."""
        if self.closed:
            return
        batch = self._batch
        if not batch:
            if not self._wbuf:
                self.loop.call_soon(self._flush)
            batch.append(fr.BATCH)
        batch.append(sid)
        batch.append(payload)
        self._batch_bytes += fr.BATCH_PAIR_OVERHEAD_BYTES + (0 if payload is None else len(payload))
        if self._batch_bytes >= self._batch_budget:
            self._seal()

    def _seal(self) -> None:
        self._wbuf.append(fr.encode(self._batch))
        self._batch, self._batch_bytes = [], 0

    def _flush(self) -> None:
        if self._batch:
            self._seal()
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
