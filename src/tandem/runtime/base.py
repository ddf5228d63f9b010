"""Protocols of the three planes (DESIGN.md §1). Implementations are chosen by name.

Every implementation is safe to use from one asyncio event loop; none is thread-safe.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Protocol

from tandem.protocols.discovery import Instance, InstanceEvent

# ---------------------------------------------------------------- discovery


class Discovery(Protocol):
    """Who serves what, where. Records live as long as their lease (process) does."""

    async def register(self, instance: Instance) -> None:
        """Publish `instance` and keep it alive (heartbeat / lease keep-alive) until
        `unregister` or `close`. Raises ValueError if the instance_id is already taken."""
        ...

    async def unregister(self, instance_id: str) -> None:
        """Remove the record now (idempotent)."""
        ...

    async def list_instances(self, prefix: str = "") -> list[Instance]:
        """Live instances whose `namespace.component.endpoint` path starts with `prefix`."""
        ...

    def watch(self, prefix: str = "") -> AsyncIterator[InstanceEvent]:
        """'added' for every live instance first, then changes as they happen. A dead
        process's records disappear ('removed') within 2 s (file, etcd backends)."""
        ...

    async def close(self) -> None:
        """Unregister everything this object registered and stop its background tasks."""
        ...


# ---------------------------------------------------------------- event plane


class Subscription(Protocol):
    """Messages of a subscription, in publish order per publisher. The buffer is bounded:
    when the consumer falls behind, the oldest messages are dropped and counted
    (`num_dropped`); receivers of KV events detect the gap by event id."""

    num_dropped: int

    def __aiter__(self) -> AsyncIterator[tuple[str, bytes]]: ...

    async def close(self) -> None: ...


class EventBus(Protocol):
    """Fire-and-forget pub/sub. Subjects are dot-separated; a subscription subject may end
    in `.>` (any suffix) or use `*` for one token, as in NATS."""

    async def publish(self, subject: str, payload: bytes) -> None: ...

    async def subscribe(self, subject: str) -> Subscription: ...

    @property
    def error(self) -> str | None:
        """Why the bus is not following its publishers now (health reports it); None while
        it is, and always for a bus that cannot fail so (NATS reconnects on its own)."""
        ...

    async def close(self) -> None: ...


# ---------------------------------------------------------------- request plane


class RequestContext(Protocol):
    """Server-side view of one in-flight request."""

    request_id: str
    deadline_s: float | None  # absolute time.time(); None = none
    traceparent: str | None  # W3C trace context of the caller's span; None = not traced

    @property
    def cancelled(self) -> asyncio.Event:
        """Set when the client cancels, disconnects or the deadline passes."""
        ...

    def try_send(self, payload: bytes) -> bool:
        """Send one response payload now, from outside the handler (e.g. an engine's step),
        if that needs no wait; False (nothing sent) when the stream is gone or must wait:
        the handler then yields it as usual. Only while the handler has nothing pending."""
        ...


# A handler receives the request payload and yields response payloads (a stream): an async
# generator, which the server closes (aclose) when the stream ends, fails or is cancelled.
# Raising a ServingError sends it to the client, which re-raises the same class.
Handler = Callable[[bytes, RequestContext], AsyncGenerator[bytes, None]]


class RequestServer(Protocol):
    """One per process; serves every endpoint that process registers."""

    @property
    def address(self) -> str:
        """host:port clients connect to (valid after start)."""
        ...

    @property
    def num_inflight(self) -> int: ...

    def register(self, endpoint_path: str, handler: Handler) -> None: ...

    async def start(self) -> None: ...

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop accepting new requests, wait up to grace_s for in-flight ones, then cancel
        the rest (clients see PeerGone and may migrate)."""
        ...


class ResponsePayloads(Protocol):
    """One request's response payloads (`RequestClient.stream`)."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def __anext__(self) -> bytes: ...

    def next_ready(self) -> bytes | None:
        """The next payload if it has already arrived, without awaiting (a reader that fell
        behind catches up without one resume per payload); None otherwise."""
        ...

    async def aclose(self) -> None:
        """End the stream early: the request is cancelled on the server (idempotent)."""
        ...


class RequestClient(Protocol):
    """Pooled connections to many servers."""

    def stream(
        self,
        address: str,
        endpoint_path: str,
        payload: bytes,
        *,
        request_id: str,
        deadline_s: float | None = None,
        connect_timeout_s: float = 5.0,
    ) -> ResponsePayloads:
        """Send one request, yield its response payloads. Closing the iterator early
        (break, aclose, task cancel) cancels the request on the server.
        Raises PeerGone if the connection breaks before the stream ends, DeadlineExceeded
        when the deadline passes, and the server's ServingError subclass if it raised one."""
        ...

    def peer_silent_s(self, address: str) -> float | None:
        """Seconds since the pooled connection to `address` last heard from its server;
        None without an open connection."""
        ...

    async def answers(self, address: str, within_s: float) -> bool:
        """Whether the server at `address` answers a PING on its pooled connection within
        `within_s` (False without an open connection)."""
        ...

    def drop(self, address: str, reason: str) -> None:
        """Abort the pooled connection to `address` (its streams fail with PeerGone naming
        `reason`); the next request connects afresh."""
        ...

    async def close(self) -> None: ...


StopCallback = Callable[[], Awaitable[None]]
