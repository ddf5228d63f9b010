"""ZeroMQ event bus: pub/sub across processes on one or many hosts, no broker to run.

Design: each bus that publishes binds one PUB socket on `tcp://<host>:<any port>` and
registers it in discovery as the reserved endpoint `<namespace>._events.pub`. Each bus that
subscribes keeps one SUB socket, watches that endpoint in discovery and connects to every
publisher (disconnecting from those that leave). The SUB socket takes every subject and
the NATS wildcard match is applied on receipt: ZMQ propagates per-prefix filters to the
publishers asynchronously, so a new subscription would miss the first messages after
`subscribe` returns, while a receive-everything socket sees them as soon as it is connected.
Frames: [subject, payload].

Fire-and-forget like NATS core: messages published before a subscriber has connected to
a publisher (discovery latency + TCP connect) are not delivered to it.

With a cluster secret the sockets speak CURVE with keys derived from it (`curve.py`: no
process without the secret can read or inject events) and every payload is also sealed
(`envelope.py`; a receiver drops what does not verify). Whatever a
peer sends, the receive loop survives it: malformed messages are dropped and counted, and a
message over `max_message_bytes` is refused by ZMQ itself (that peer is disconnected).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from tandem.protocols.discovery import Instance, InstanceEvent, endpoint_path
from tandem.runtime.base import Discovery
from tandem.runtime.events import curve
from tandem.runtime.events.envelope import EventOpener, EventSealer
from tandem.runtime.events.subject import validate_pattern, validate_subject
from tandem.runtime.events.subscription import BufferedSubscription
from tandem.runtime.task import cancel_and_wait

logger = logging.getLogger(__name__)
PUBLISHER_COMPONENT, PUBLISHER_ENDPOINT = "_events", "pub"
DRAIN_BATCH = 64  # messages read without awaiting, per wake-up of the receive loop


class ZmqEventBus:
    """Implements `EventBus`. Sockets are created lazily (PUB on the first publish, SUB on
    the first subscribe); `close` unregisters the publisher and closes both."""

    def __init__(
        self,
        discovery: Discovery,
        *,
        namespace: str = "tandem",
        host: str = "127.0.0.1",
        advertise_host: str = "",
        port: int = 0,
        buffer_size: int = 10_000,
        secret: str | None = None,
        max_message_bytes: int = 16 << 20,
    ) -> None:
        self.discovery, self.namespace, self.host = discovery, namespace, host
        self.advertise_host = advertise_host or host  # what subscribers dial (never 0.0.0.0)
        self.port = port  # 0: any free port
        self._buffer_size = buffer_size
        self._sealer = EventSealer(secret) if secret else None
        self._opener = EventOpener(secret) if secret else None
        self._max_message_bytes = max_message_bytes
        self.num_malformed = 0
        self._keys = curve.curve_keys(secret) if secret else None
        self._auth: AsyncioAuthenticator | None = None
        self._ctx = zmq.asyncio.Context()
        self._pub: zmq.asyncio.Socket | None = None
        self._publisher_id: str | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._subs: list[BufferedSubscription] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._connected: set[str] = set()
        self.error: str | None = None  # why the bus is not following its publishers now

    @property
    def num_rejected(self) -> int:
        """Messages dropped: malformed, or (with a secret) not sealed with it."""
        return self.num_malformed + (self._opener.num_rejected if self._opener else 0)

    @property
    def publishers_path(self) -> str:
        return endpoint_path(self.namespace, PUBLISHER_COMPONENT, PUBLISHER_ENDPOINT)

    async def _start_publisher(self) -> zmq.asyncio.Socket:
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        if self._keys is not None:
            self._auth = curve.start_authenticator(self._ctx, self._keys)
            curve.make_server(pub, self._keys)
        pub.bind(f"tcp://{self.host}:{self.port}")
        port = pub.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
        self._publisher_id = f"events-{uuid.uuid4().hex[:12]}"
        await self.discovery.register(
            Instance(
                instance_id=self._publisher_id,
                namespace=self.namespace,
                component=PUBLISHER_COMPONENT,
                endpoint=PUBLISHER_ENDPOINT,
                address=f"{self.advertise_host}:{port}",
            )
        )
        self._pub = pub
        return pub

    async def publish(self, subject: str, payload: bytes) -> None:
        validate_subject(subject)
        pub = self._pub or await self._start_publisher()
        if self._sealer is not None:
            payload = self._sealer.seal(subject, payload)
        await pub.send_multipart([subject.encode(), payload])

    def _start_subscriber(self) -> zmq.asyncio.Socket:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        if self._keys is not None:
            curve.make_client(sub, self._keys)
        self._sub = sub
        self._tasks.append(asyncio.create_task(self._follow_publishers(sub), name="zmq-peers"))
        self._tasks.append(asyncio.create_task(self._receive(sub), name="zmq-receive"))
        return sub

    async def subscribe(self, subject: str) -> BufferedSubscription:
        validate_pattern(subject)
        sub = BufferedSubscription(subject, self._buffer_size, on_close=self._unsubscribe)
        if self._sub is None:
            self._start_subscriber()
        self._subs.append(sub)
        return sub

    async def _unsubscribe(self, sub: BufferedSubscription) -> None:
        if sub in self._subs:
            self._subs.remove(sub)

    async def _follow_publishers(self, sock: zmq.asyncio.Socket) -> None:
        """Connect to every publisher in discovery. A failed watch (e.g. out of file
        descriptors) is retried with back-off, never left frozen; `error` says why meanwhile."""
        backoff_s = 0.05
        while True:
            try:
                async for event in self.discovery.watch(self.publishers_path):
                    self.error, backoff_s = None, 0.05
                    self._on_publisher(sock, event)
                raise RuntimeError("discovery watch ended")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self.error is None:
                    logger.warning("zmq event bus: publisher watch failed; retrying", exc_info=True)
                self.error = f"publisher watch: {type(exc).__name__}: {exc}"
                await asyncio.sleep(backoff_s)
                backoff_s = min(2.0, backoff_s * 2)

    def _on_publisher(self, sock: zmq.asyncio.Socket, event: InstanceEvent) -> None:
        url = f"tcp://{event.instance.address}"
        if event.kind == "added" and url not in self._connected:
            sock.connect(url)
            self._connected.add(url)
        elif event.kind == "removed" and url in self._connected:
            self._connected.discard(url)
            with contextlib.suppress(zmq.ZMQError):
                sock.disconnect(url)

    async def _receive(self, sock: zmq.asyncio.Socket) -> None:
        """Deliver what arrives. One awaited receive per wake-up, then what is already queued
        is read through a plain (shadow) socket, up to `DRAIN_BATCH` messages before the
        loop gets a turn: an awaited receive costs a future and its callbacks per message,
        and under load the workers' events arrive several to a wake-up."""
        drain: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        try:
            while True:
                self._deliver(await sock.recv_multipart())
                for _ in range(DRAIN_BATCH):
                    try:
                        msg = drain.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._deliver(msg)
                else:
                    await asyncio.sleep(0)  # more queued: let the loop run between batches
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("zmq event bus receive loop failed")

    def _deliver(self, msg: list[bytes]) -> None:
        try:
            subject_b, payload = msg
            subject = subject_b.decode()
        except ValueError:  # not [subject, payload], or a subject that is not UTF-8
            self.num_malformed += 1
            return
        if self._opener is not None:
            opened = self._opener.open(subject, payload)
            if opened is None:
                return
            payload = opened
        for sub in self._subs:
            if sub.matches(subject):
                sub.push(subject, payload)

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)
        self._tasks.clear()
        for sub in list(self._subs):
            await sub.close()
        if self._publisher_id is not None:
            await self.discovery.unregister(self._publisher_id)
            self._publisher_id = None
        for sock in (self._pub, self._sub):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._sub = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._ctx.term()
