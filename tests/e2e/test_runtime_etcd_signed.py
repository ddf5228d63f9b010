"""Signed etcd discovery records against a real etcd: a writer without the cluster secret
(raw v3 JSON gateway requests, as `etcdctl` would send) cannot add, move or alter a record
that a tandem reader accepts, and a live owner puts back a record someone deleted."""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import time
import urllib.request
from typing import Any

import msgspec
import pytest
from tests.support.services import Service

from tandem.protocols.discovery import Instance, InstanceEvent
from tandem.runtime.discovery.etcd import EtcdDiscovery, prefix_end

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]
ROOT = "tandem/instances/"


def _gateway(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        return dict(json.loads(r.read()))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _records(url: str) -> dict[str, bytes]:
    """Every value under the instances prefix, by key (what an attacker can read)."""
    root = ROOT.encode()
    data = _gateway(url, "/v3/kv/range", {"key": _b64(root), "range_end": _b64(prefix_end(root))})
    return {
        base64.b64decode(kv["key"]).decode(): base64.b64decode(kv["value"])
        for kv in data.get("kvs", [])
    }


def _put(url: str, key: str, value: bytes) -> None:
    _gateway(url, "/v3/kv/put", {"key": _b64(key.encode()), "value": _b64(value)})


def _instance(iid: str, address: str = "127.0.0.1:1") -> Instance:
    return Instance(
        instance_id=iid, namespace="t", component="backend", endpoint="generate", address=address
    )


async def _next(events: Any, timeout_s: float = 5.0) -> InstanceEvent:
    return await asyncio.wait_for(anext(events), timeout_s)  # type: ignore[no-any-return]


async def test_unsigned_moved_and_altered_records_are_ignored(etcd_server: Service) -> None:
    secret = secrets.token_hex(32)
    owner = EtcdDiscovery(etcd_server.url, ttl_s=1, secret=secret)
    reader = EtcdDiscovery(etcd_server.url, ttl_s=1, secret=secret)
    foreign = EtcdDiscovery(etcd_server.url, ttl_s=1, secret=secrets.token_hex(32))
    url = etcd_server.url
    try:
        await owner.register(_instance("real"))
        events = reader.watch("t.backend")
        assert (await _next(events)).instance.instance_id == "real"
        (real_key, real_value), = _records(url).items()  # fmt: skip

        # 1. a plain record written without the secret (the format before signing)
        fake = msgspec.json.encode(_instance("fake", "10.9.9.9:1"))
        _put(url, f"{ROOT}t.backend.generate/fake", fake)
        # 2. the real sealed record copied under another key (a replayed registration)
        _put(url, f"{ROOT}t.backend.generate/copy", real_value)
        # 3. a record sealed with another cluster's secret
        await foreign.register(_instance("foreign"))
        # 4. garbage (before signing this killed the watch with a DecodeError)
        _put(url, f"{ROOT}t.backend.generate/junk", b"\xff not json")
        # a valid one after them, so the watch has certainly read past the fakes
        await owner.register(_instance("real2"))
        ev = await _next(events)
        assert (ev.kind, ev.instance.instance_id) == ("added", "real2")
        assert {i.instance_id for i in await reader.list_instances()} == {"real", "real2"}
        assert reader.num_forged == 4

        # 5. the real record altered in place (its address pointed elsewhere): readers drop it,
        # and its owner puts the original back within a keep-alive period (TTL/3)
        sealed = json.loads(real_value)
        sealed["record"]["address"] = "10.9.9.9:1"
        _put(url, real_key, json.dumps(sealed).encode())
        ev = await _next(events)
        assert (ev.kind, ev.instance.instance_id) == ("removed", "real")
        ev = await _next(events, timeout_s=3)
        assert (ev.kind, ev.instance.instance_id) == ("added", "real")
        assert ev.instance.address == "127.0.0.1:1"
        assert _records(url)[real_key] == real_value

        # 6. the real record deleted by someone else: back within a keep-alive period
        _gateway(url, "/v3/kv/deleterange", {"key": _b64(real_key.encode())})
        deleted_at = time.monotonic()
        ev = await _next(events)
        assert (ev.kind, ev.instance.instance_id) == ("removed", "real")
        ev = await _next(events, timeout_s=3)
        assert (ev.kind, ev.instance.instance_id) == ("added", "real")
        assert time.monotonic() - deleted_at < 2.0
        assert {i.instance_id for i in await reader.list_instances()} == {"real", "real2"}
        # each forged version counted once, however often it is read
        assert reader.num_forged == 5
    finally:
        for d in (owner, reader, foreign):
            await d.close()


async def test_without_a_secret_records_are_read_as_before(etcd_server: Service) -> None:
    a, b = EtcdDiscovery(etcd_server.url, ttl_s=1), EtcdDiscovery(etcd_server.url, ttl_s=1)
    try:
        await a.register(_instance("x"))
        assert [i.instance_id for i in await b.list_instances()] == ["x"]
        # a secret-less reader accepts a signed record too (the tag is not checked)
        signed = EtcdDiscovery(etcd_server.url, ttl_s=1, secret=secrets.token_hex(32))
        try:
            await signed.register(_instance("y"))
            assert {i.instance_id for i in await b.list_instances()} == {"x", "y"}
        finally:
            await signed.close()
    finally:
        await a.close()
        await b.close()
