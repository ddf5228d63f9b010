"""etcd discovery over etcd's v3 JSON gateway (HTTP + aiohttp; no grpc dependency).

Each process holds one lease (TTL `ttl_s`, rounded up to whole seconds; etcd clamps it to
its minimum, 2 s with default election settings) renewed every TTL/3. Every instance is a key
`<key_root><namespace.component.endpoint>/<instance_id>` bound to that lease, so a dead
process's records vanish when its lease expires (≈ TTL after its last keep-alive);
`unregister`/`close` delete them at once. `watch` = range (snapshot + revision) then a
streamed `/v3/watch` from the next revision; when the stream breaks it re-ranges and emits
the difference, so no change is lost.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import math
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec

from tandem.protocols.discovery import Instance, InstanceEvent
from tandem.runtime.task import cancel_and_wait

logger = logging.getLogger(__name__)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key starting with `prefix` (etcd range_end)."""
    p = bytearray(prefix)
    while p and p[-1] == 0xFF:
        p.pop()
    if not p:
        return b"\0"  # every key
    p[-1] += 1
    return bytes(p)


class EtcdError(RuntimeError):
    """etcd answered with an error or could not be reached."""


class EtcdDiscovery:
    """Implements `Discovery`. `url` is etcd's client URL, e.g. http://127.0.0.1:2379."""

    def __init__(
        self,
        url: str,
        *,
        ttl_s: float = 2.0,
        key_root: str = "tandem/instances/",
        request_timeout_s: float = 5.0,
    ) -> None:
        self.url, self.key_root = url.rstrip("/"), key_root
        self.ttl_s = max(1, math.ceil(ttl_s))
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._lease_id: str | None = None
        self._owned: dict[str, tuple[str, str]] = {}  # instance_id -> (b64 key, b64 value)
        self._keepalive: asyncio.Task[None] | None = None

    def _key(self, instance: Instance) -> bytes:
        return f"{self.key_root}{instance.path}/{instance.instance_id}".encode()

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            async with self._sess().post(self.url + path, json=body, timeout=self._timeout) as r:
                data = await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EtcdError(f"etcd at {self.url} unreachable on {path}: {exc!r}") from exc
        if r.status != 200 or "error" in data:
            raise EtcdError(f"etcd {path} failed ({r.status}): {data}")
        return dict(data)

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One v3 JSON gateway request on this client's connection, for other state kept in
        the same etcd (`tandem.runtime.blobs.etcd`); raises EtcdError."""
        return await self._post(path, body)

    async def _grant(self) -> str:
        data = await self._post("/v3/lease/grant", {"TTL": self.ttl_s})
        logger.info("etcd lease %s granted, TTL %ss", data["ID"], data.get("TTL"))
        return str(data["ID"])

    async def register(self, instance: Instance) -> None:
        key = self._key(instance)
        if (await self._range(key))[0]:
            raise ValueError(f"instance_id {instance.instance_id!r} is already registered")
        if self._lease_id is None:
            self._lease_id = await self._grant()
        entry = (_b64(key), _b64(msgspec.json.encode(instance)))
        await self._put(entry)
        self._owned[instance.instance_id] = entry
        if self._keepalive is None:
            self._keepalive = asyncio.create_task(self._keep_alive(), name="etcd-keepalive")

    async def _put(self, entry: tuple[str, str]) -> None:
        await self._post(
            "/v3/kv/put", {"key": entry[0], "value": entry[1], "lease": self._lease_id}
        )

    async def unregister(self, instance_id: str) -> None:
        entry = self._owned.pop(instance_id, None)
        if entry is not None:
            await self._post("/v3/kv/deleterange", {"key": entry[0]})
            return
        for inst in await self.list_instances():
            if inst.instance_id == instance_id:
                await self._post("/v3/kv/deleterange", {"key": _b64(self._key(inst))})

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                data = await self._post("/v3/lease/keepalive", {"ID": self._lease_id})
                if int(data.get("result", {}).get("TTL", 0)) <= 0:
                    await self._regrant()
            except EtcdError as exc:
                logger.warning("etcd keep-alive failed: %s", exc)

    async def _regrant(self) -> None:
        logger.warning(
            "etcd lease %s expired; re-registering %d instances", self._lease_id, len(self._owned)
        )
        self._lease_id = await self._grant()
        for entry in list(self._owned.values()):
            await self._put(entry)

    async def _range(self, prefix: bytes) -> tuple[dict[str, Instance], int]:
        """Instances under key prefix `prefix` by key, and the store revision."""
        data = await self._post(
            "/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
        )
        found = {}
        for kv in data.get("kvs", []):
            found[kv["key"]] = msgspec.json.decode(base64.b64decode(kv["value"]), type=Instance)
        return found, int(data["header"]["revision"])

    async def list_instances(self, prefix: str = "") -> list[Instance]:
        found, _ = await self._range((self.key_root + prefix).encode())
        return list(found.values())

    async def watch(self, prefix: str = "") -> AsyncIterator[InstanceEvent]:
        key = (self.key_root + prefix).encode()
        known: dict[str, Instance] = {}
        while True:
            try:
                current, revision = await self._range(key)
            except EtcdError as exc:
                logger.warning("etcd watch of %r: %s; retrying", prefix, exc)
                await asyncio.sleep(0.5)
                continue
            for event in _diff(known, current):
                yield event
            known = current
            async for event in self._stream(key, revision + 1, known):
                yield event
            await asyncio.sleep(0.1)  # stream broke: re-sync by range (no busy loop)

    async def _stream(
        self, key: bytes, start_revision: int, known: dict[str, Instance]
    ) -> AsyncIterator[InstanceEvent]:
        """Events of one /v3/watch stream; updates `known`; ends when the stream breaks."""
        body = {
            "create_request": {
                "key": _b64(key),
                "range_end": _b64(prefix_end(key)),
                "start_revision": start_revision,
                "prev_kv": True,
            }
        }
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._timeout.total)
        try:
            async with self._sess().post(
                self.url + "/v3/watch", json=body, timeout=timeout, read_bufsize=1 << 20
            ) as r:
                async for line in r.content:
                    if line.strip():
                        for event in _events(json.loads(line), known):
                            yield event
        except (aiohttp.ClientError, ValueError) as exc:
            logger.warning("etcd watch stream at %s broke: %r", self.url, exc)

    async def close(self) -> None:
        await cancel_and_wait([self._keepalive])
        self._keepalive = None
        with contextlib.suppress(EtcdError):
            for instance_id in list(self._owned):
                await self.unregister(instance_id)
            if self._lease_id is not None:
                await self._post("/v3/lease/revoke", {"ID": self._lease_id})
        self._lease_id = None
        if self._session is not None:
            await self._session.close()
            self._session = None


def _diff(known: dict[str, Instance], current: dict[str, Instance]) -> list[InstanceEvent]:
    added = [InstanceEvent(kind="added", instance=i) for k, i in current.items() if k not in known]
    gone = [InstanceEvent(kind="removed", instance=i) for k, i in known.items() if k not in current]
    return added + gone


def _events(message: dict[str, Any], known: dict[str, Instance]) -> list[InstanceEvent]:
    result = message.get("result", {})
    if "error" in message or result.get("canceled"):
        raise ValueError(f"etcd watch ended: {message}")
    out = []
    for ev in result.get("events", []):
        key = ev["kv"]["key"]
        if ev.get("type") == "DELETE":
            inst = known.pop(key, None)
            if inst is not None:
                out.append(InstanceEvent(kind="removed", instance=inst))
        else:
            inst = msgspec.json.decode(base64.b64decode(ev["kv"]["value"]), type=Instance)
            if key not in known:
                out.append(InstanceEvent(kind="added", instance=inst))
            known[key] = inst
    return out
