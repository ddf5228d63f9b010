"""Blobs in etcd, chunked, next to the discovery records (the cluster's one shared store when
workers and frontends run on different hosts).

Keys under `tandem/blobs/<sha256>/`: `c/<i>` the chunks (CHUNK_BYTES each, far below etcd's
1.5 MiB request limit even base64-encoded by the JSON gateway), `m` the size and chunk count,
written after the last chunk (a blob without `m` is incomplete), and `h/<lease>` one key per
holder, bound to that process's lease. A blob is written once per content: a put that finds
it intact only adds its holder key. Lifetime is by reference count: the chunks carry no
lease; a transaction deletes `tandem/blobs/<sha256>/` only when no `h/` key is left, run by a
holder's `close` and, for holders that died (their keys went with their lease), by a sweep at
any process's first put. A holder key is written before the chunks are looked at, so a sweep
never deletes a blob someone is putting.

Requests go through the discovery client's connection (`EtcdDiscovery.call`), so whatever
authenticates it (TLS, users) carries over. The store keeps its own lease, renewed like the
discovery's.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from tandem.runtime.blobs.base import (
    BlobError,
    BlobMissingError,
    blob_id,
    check_blob_id,
    check_size,
    verified,
)
from tandem.runtime.discovery.etcd import EtcdError, prefix_end
from tandem.runtime.task import cancel_and_wait

logger = logging.getLogger(__name__)

CHUNK_BYTES = 512 << 10
EtcdCall = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


class _Meta(msgspec.Struct, kw_only=True):
    size: int
    num_chunks: int


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class EtcdBlobStore:
    """Implements `BlobStore`. `call(path, body)` is one etcd v3 JSON gateway request
    (`EtcdDiscovery.call`); `where` names etcd in messages."""

    def __init__(
        self,
        call: EtcdCall,
        *,
        where: str = "etcd",
        ttl_s: float = 2.0,
        key_root: str = "tandem/blobs/",
    ) -> None:
        self._call, self.where, self.key_root = call, where, key_root
        self.ttl_s = max(1, math.ceil(ttl_s))
        self._lease_id: str | None = None
        self._keepalive: asyncio.Task[None] | None = None
        self._held: dict[str, bytes] = {}  # sha -> bytes, to write back after a lapse
        self._swept = False

    def _key(self, sha: str, suffix: str) -> bytes:
        return f"{self.key_root}{sha}/{suffix}".encode()

    async def put(self, data: bytes) -> str:
        sha = blob_id(check_size(data))
        lease = await self._lease()
        await self._put(self._key(sha, f"h/{lease}"), b"", lease=lease)
        self._held[sha] = data
        try:
            await self.get(sha)
        except BlobError:
            await self._write(sha, data)
        if not self._swept:
            self._swept = True
            await self.sweep()
        return sha

    async def _write(self, sha: str, data: bytes) -> None:
        chunks = [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
        for i, chunk in enumerate(chunks):
            await self._put(self._key(sha, f"c/{i:06d}"), chunk)
        meta = msgspec.json.encode(_Meta(size=len(data), num_chunks=len(chunks)))
        await self._put(self._key(sha, "m"), meta)
        logger.info("blob %s… stored in %s (%d bytes)", sha[:16], self.where, len(data))

    async def get(self, sha256: str) -> bytes:
        raw = await self._value(self._key(check_blob_id(sha256), "m"))
        if raw is None:
            raise BlobMissingError(f"blob {sha256[:16]}… is not in {self.where}")
        meta = msgspec.json.decode(raw, type=_Meta)
        parts = []
        for i in range(meta.num_chunks):
            chunk = await self._value(self._key(sha256, f"c/{i:06d}"))
            if chunk is None:
                raise BlobMissingError(
                    f"blob {sha256[:16]}… in {self.where} lacks chunk {i} of {meta.num_chunks}"
                )
            parts.append(chunk)
        return verified(sha256, b"".join(parts), where=self.where)

    async def sweep(self) -> int:
        """Delete every blob no holder key names (their holders died); returns how many."""
        root = self.key_root.encode()
        data = await self._call(
            "/v3/kv/range",
            {"key": _b64(root), "range_end": _b64(prefix_end(root)), "keys_only": True},
        )
        shas, held = set(), set()
        for kv in data.get("kvs", []):
            sha, _, rest = base64.b64decode(kv["key"]).decode()[len(self.key_root) :].partition("/")
            shas.add(sha)
            if rest.startswith("h/"):
                held.add(sha)
        deleted = [sha for sha in sorted(shas - held) if await self._delete_unheld(sha)]
        if deleted:
            logger.info("swept %d blobs nobody holds from %s", len(deleted), self.where)
        return len(deleted)

    async def _delete_unheld(self, sha: str) -> bool:
        """Delete blob `sha` if no holder key is left (one transaction); True if deleted."""
        holders, blob = self._key(sha, "h/"), self._key(sha, "")
        result = await self._call(
            "/v3/kv/txn",
            {
                "compare": [
                    {
                        "key": _b64(holders),
                        "range_end": _b64(prefix_end(holders)),
                        "target": "VERSION",
                        "result": "EQUAL",
                        "version": "0",
                    }
                ],
                "success": [
                    {
                        "request_delete_range": {
                            "key": _b64(blob),
                            "range_end": _b64(prefix_end(blob)),
                        }
                    }
                ],
            },
        )
        return bool(result.get("succeeded"))

    async def close(self) -> None:
        await cancel_and_wait([self._keepalive])
        self._keepalive = None
        held, self._held = list(self._held), {}
        try:
            for sha in held:
                await self._call(
                    "/v3/kv/deleterange", {"key": _b64(self._key(sha, f"h/{self._lease_id}"))}
                )
                await self._delete_unheld(sha)
            if self._lease_id is not None:
                await self._call("/v3/lease/revoke", {"ID": self._lease_id})
        except EtcdError as exc:  # the lease expires anyway; a later sweep deletes the rest
            logger.warning("releasing blobs in %s: %s", self.where, exc)
        self._lease_id = None

    async def _lease(self) -> str:
        if self._lease_id is None:
            self._lease_id = str((await self._call("/v3/lease/grant", {"TTL": self.ttl_s}))["ID"])
            self._keepalive = asyncio.create_task(self._keep_alive(), name="etcd-blob-keepalive")
        return self._lease_id

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                data = await self._call("/v3/lease/keepalive", {"ID": self._lease_id})
                if int(data.get("result", {}).get("TTL", 0)) <= 0:
                    await self._regrant()
            except EtcdError as exc:
                logger.warning("etcd keep-alive of the blob holder lease failed: %s", exc)

    async def _regrant(self) -> None:
        """The lease expired (this process stalled): hold the blobs again under a new one,
        writing back any that a sweep deleted meanwhile."""
        logger.warning(
            "etcd blob lease %s expired; holding %d blobs again", self._lease_id, len(self._held)
        )
        self._lease_id = str((await self._call("/v3/lease/grant", {"TTL": self.ttl_s}))["ID"])
        for sha, data in list(self._held.items()):
            await self._put(self._key(sha, f"h/{self._lease_id}"), b"", lease=self._lease_id)
            try:
                await self.get(sha)
            except BlobError:
                await self._write(sha, data)

    async def _put(self, key: bytes, value: bytes, *, lease: str | None = None) -> None:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease is not None:
            body["lease"] = lease
        await self._call("/v3/kv/put", body)

    async def _value(self, key: bytes) -> bytes | None:
        data = await self._call("/v3/kv/range", {"key": _b64(key)})
        kvs = data.get("kvs", [])
        return base64.b64decode(kvs[0].get("value", "")) if kvs else None
