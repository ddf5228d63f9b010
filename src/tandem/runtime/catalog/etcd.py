"""Catalog records as etcd keys `tandem/catalog/<key>`, held by no lease (they stay until
deleted), each value sealed with its key under the cluster secret."""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable
from typing import Any

from tandem.runtime.catalog.base import Sealer, check_record
from tandem.runtime.discovery.etcd import prefix_end
from tandem.runtime.discovery.sealed import seal

Call = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]
KEY_ROOT = "tandem/catalog/"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class EtcdRecordStore:
    """Implements `RecordStore` on an etcd client's `call` (EtcdDiscovery.call; raises its
    EtcdError when etcd cannot be reached)."""

    def __init__(self, call: Call, *, where: str, secret: str | None = None) -> None:
        self._call, self._where = call, where
        self._sealer = Sealer(secret)

    @property
    def where(self) -> str:
        return self._where

    async def get(self, key: str) -> bytes | None:
        data = await self._call("/v3/kv/range", {"key": _b64((KEY_ROOT + key).encode())})
        kvs = data.get("kvs", [])
        if not kvs:
            return None
        return self._sealer.open(key, base64.b64decode(kvs[0].get("value", "")), self.where)

    async def put(self, key: str, value: bytes) -> None:
        check_record(key, value)
        sealed = seal(value, self._sealer.key, key.encode())
        body = {"key": _b64((KEY_ROOT + key).encode()), "value": _b64(sealed)}
        await self._call("/v3/kv/put", body)

    async def delete(self, key: str) -> bool:
        data = await self._call("/v3/kv/deleterange", {"key": _b64((KEY_ROOT + key).encode())})
        return int(data.get("deleted", 0)) > 0

    async def items(self, prefix: str) -> dict[str, bytes]:
        start = (KEY_ROOT + prefix).encode()
        data = await self._call(
            "/v3/kv/range", {"key": _b64(start), "range_end": _b64(prefix_end(start))}
        )
        found = {}
        for kv in data.get("kvs", []):
            key = base64.b64decode(kv["key"]).decode(errors="replace").removeprefix(KEY_ROOT)
            value = self._sealer.open(key, base64.b64decode(kv.get("value", "")), self.where)
            if value is not None:
                found[key] = value
        return found
