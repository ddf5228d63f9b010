"""etcd discovery over etcd's v3 JSON gateway (HTTP + aiohttp; no grpc dependency).

Each process holds one lease (TTL `ttl_s`, rounded up to whole seconds; etcd clamps it to
its minimum, 2 s with default election settings) renewed every TTL/3. Every instance is a key
`<key_root><namespace.component.endpoint>/<instance_id>` bound to that lease, so a dead
process's records vanish when its lease expires (≈ TTL after its last keep-alive);
`unregister`/`close` delete them at once. `watch` = range (snapshot + revision) then a
streamed `/v3/watch` from the next revision; when the stream breaks it re-ranges and emits
the difference, so no change is lost.

With a cluster secret each value is a `SealedRecord` (the instance's JSON and an HMAC tag over
the key and those bytes, keyed for this plane), so whoever can write to etcd without the secret
cannot add, alter or move a record: a record that does not verify is ignored by readers (as if
absent), counted in `num_forged` and logged once per key. Each owner checks its own keys every
TTL/3 and puts them back when someone deleted or altered them. etcd's own access control
(users, client certificates, TLS: `EtcdAuth`) decides who may write at all.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import math
import os
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from tandem.protocols.discovery import Instance, InstanceEvent
from tandem.runtime.discovery.sealed import ForgedRecordError, seal, unseal
from tandem.runtime.secret import key_for
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


class EtcdAuthError(EtcdError):
    """etcd refused this client (wrong or missing user/password, certificate or CA, or no
    permission on the key prefix): retrying does not help, so watchers give up on it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EtcdAuth:
    """How this client proves itself to etcd: a user (the gateway's /v3/auth/authenticate
    token, sent as the Authorization header and renewed when etcd says it expired), client
    certificates and the CA that signed etcd's server certificate (https:// URLs)."""

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def __post_init__(self) -> None:
        if (self.user is None) != (self.password is None):
            raise ValueError("etcd user and password go together: give both or neither")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("etcd client cert and key go together: give both or neither")

    @property
    def uses_tls(self) -> bool:
        return any((self.ca_file, self.cert_file))

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.uses_tls:
            return None
        try:
            ctx = ssl.create_default_context(cafile=self.ca_file)
            if self.cert_file is not None:
                ctx.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"etcd TLS files cannot be loaded: {exc}") from exc
        return ctx


_PURPOSE = "etcd-discovery/v1"
_MAX_REMEMBERED_FORGED = 4096


def seal_record(key: bytes, instance: Instance, secret_key: bytes | None) -> bytes:
    """An etcd value: the instance sealed (`sealed.py`), its tag bound to the etcd key."""
    return seal(msgspec.json.encode(instance), secret_key, key)


def open_record(key: bytes, value: bytes, secret_key: bytes | None) -> Instance:
    """The instance in `value` stored at `key`; raises ForgedRecordError when it is malformed
    or (with a secret) its tag does not verify for this key."""
    try:
        return msgspec.json.decode(unseal(value, secret_key, key), type=Instance)
    except msgspec.DecodeError as exc:
        raise ForgedRecordError(f"not a tandem record: {exc}") from exc


class EtcdDiscovery:
    """Implements `Discovery`. `url` is etcd's client URL, e.g. http://127.0.0.1:2379
    (https:// with `auth`'s CA and client certificates)."""

    def __init__(
        self,
        url: str,
        *,
        ttl_s: float = 2.0,
        key_root: str = "tandem/instances/",
        request_timeout_s: float = 5.0,
        secret: str | None = None,
        auth: EtcdAuth | None = None,
    ) -> None:
        self.url, self.key_root = url.rstrip("/"), key_root
        self.ttl_s = max(1, math.ceil(ttl_s))
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._auth = auth or EtcdAuth()
        self._ssl = self._auth.ssl_context()
        if self._ssl is not None and not self.url.startswith("https://"):
            raise ValueError(f"etcd TLS options need an https:// URL, got {url!r}")
        self._token: str | None = None
        self._secret_key = key_for(secret, _PURPOSE) if secret else None
        self.num_forged = 0  # distinct record versions ignored (forged, altered, foreign)
        self._forged_seen: set[tuple[str, str]] = set()  # (b64 key, mod_revision)
        self._forged_logged: set[str] = set()
        self._session: aiohttp.ClientSession | None = None
        self._lease_id: str | None = None
        self._owned: dict[str, tuple[str, str]] = {}  # instance_id -> (b64 key, b64 value)
        self._keepalive: asyncio.Task[None] | None = None

    def _key(self, instance: Instance) -> bytes:
        return f"{self.key_root}{instance.path}/{instance.instance_id}".encode()

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self._ssl) if self._ssl is not None else None
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def _headers(self) -> dict[str, str]:
        if self._auth.user is None:
            return {}
        if self._token is None:
            self._token = await self._authenticate()
        return {"Authorization": self._token}

    async def _authenticate(self) -> str:
        body = {"name": self._auth.user, "password": self._auth.password}
        status, data = await self._request("/v3/auth/authenticate", body, {})
        if status != 200 or "token" not in data:
            raise EtcdAuthError(
                f"etcd at {self.url} refused user {self._auth.user!r} ({status}: "
                f"{data.get('message') or data.get('error') or data}); check --etcd-user and "
                "--etcd-password"
            )
        return str(data["token"])

    async def _request(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> tuple[int, dict[str, Any]]:
        try:
            async with self._sess().post(
                self.url + path, json=body, headers=headers, timeout=self._timeout
            ) as r:
                return r.status, dict(await r.json(content_type=None))
        except aiohttp.ClientSSLError as exc:
            raise EtcdAuthError(
                f"TLS with etcd at {self.url} failed on {path}: {exc}; check --etcd-ca-file, "
                "--etcd-cert-file and --etcd-key-file"
            ) from exc
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise EtcdError(f"etcd at {self.url} unreachable on {path}: {_reason(exc)}") from exc

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        status, data = await self._request(path, body, await self._headers())
        if _is_expired_token(data) and self._auth.user is not None:
            self._token = None  # expired (etcd's simple tokens live 5 min): log in again
            status, data = await self._request(path, body, await self._headers())
        if status != 200 or "error" in data:
            text = f"etcd {path} at {self.url} failed ({status}): {data}"
            if _is_auth_failure(status, data):
                hint = "--etcd-user/--etcd-password" if self._auth.user else "no --etcd-user given"
                raise EtcdAuthError(f"{text}; etcd requires credentials with access ({hint})")
            raise EtcdError(text)
        return data

    async def check_access(self) -> None:
        """Log in (with a user) and read one key under `key_root` now, so that a process
        whose credentials, certificates or permissions etcd refuses fails at start with
        EtcdAuthError rather than in a watch; EtcdError when etcd cannot be reached."""
        root = self.key_root.encode()
        await self._post(
            "/v3/kv/range",
            {"key": _b64(root), "range_end": _b64(prefix_end(root)), "limit": 1, "keys_only": True},
        )

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
        entry = (_b64(key), _b64(seal_record(key, instance, self._secret_key)))
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
                else:
                    await self._restore_owned()
            except EtcdError as exc:
                logger.warning("etcd keep-alive failed: %s", exc)

    async def _restore_owned(self) -> None:
        """Put back each of our records that someone else deleted or altered (whoever can
        write to etcd can; with a cluster secret readers ignore an altered one meanwhile)."""
        for instance_id, entry in list(self._owned.items()):
            data = await self._post("/v3/kv/range", {"key": entry[0]})
            kvs = data.get("kvs", [])
            if kvs and kvs[0].get("value") == entry[1] and kvs[0].get("lease") == self._lease_id:
                continue
            if instance_id not in self._owned:
                continue  # unregistered meanwhile
            logger.warning(
                "discovery record of instance_id=%s was %s by another etcd client; "
                "re-registering it",
                instance_id,
                "altered" if kvs else "deleted",
            )
            await self._put(entry)

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
            inst = self._open(kv)
            if inst is not None:
                found[kv["key"]] = inst
        return found, int(data["header"]["revision"])

    def _open(self, kv: dict[str, Any]) -> Instance | None:
        """The instance an etcd key-value holds, or None when it does not verify (counted
        once per version, logged once per key)."""
        key = base64.b64decode(kv["key"])
        try:
            return open_record(key, base64.b64decode(kv.get("value", "")), self._secret_key)
        except ForgedRecordError as exc:
            version = (kv["key"], str(kv.get("mod_revision")))
            if version not in self._forged_seen:
                if len(self._forged_seen) >= _MAX_REMEMBERED_FORGED:
                    self._forged_seen.clear()
                self._forged_seen.add(version)
                self.num_forged += 1
            if kv["key"] not in self._forged_logged:
                if len(self._forged_logged) < _MAX_REMEMBERED_FORGED:
                    self._forged_logged.add(kv["key"])
                logger.warning(
                    "ignoring etcd discovery record %r: %s", key.decode(errors="replace"), exc
                )
            return None

    async def list_instances(self, prefix: str = "") -> list[Instance]:
        found, _ = await self._range((self.key_root + prefix).encode())
        return list(found.values())

    async def watch(self, prefix: str = "") -> AsyncIterator[InstanceEvent]:
        key = (self.key_root + prefix).encode()
        known: dict[str, Instance] = {}
        while True:
            try:
                current, revision = await self._range(key)
            except EtcdAuthError:
                raise  # retrying cannot help; the caller reports it
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
            headers = await self._headers()
            async with self._sess().post(
                self.url + "/v3/watch",
                json=body,
                headers=headers,
                timeout=timeout,
                read_bufsize=1 << 20,
            ) as r:
                async for line in r.content:
                    if line.strip():
                        for event in _events(json.loads(line), known, self._open):
                            yield event
        except (aiohttp.ClientError, ValueError, EtcdError) as exc:
            if "auth token" in str(exc):
                self._token = None  # expired: the next range logs in again
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


def _is_expired_token(data: dict[str, Any]) -> bool:
    return "invalid auth token" in str(data.get("error") or data.get("message") or "")


def _is_auth_failure(status: int, data: dict[str, Any]) -> bool:
    text = str(data.get("error") or data.get("message") or "").lower()
    return status in (401, 403) or any(
        word in text for word in ("permission denied", "user name is empty", "auth")
    )


def _events(
    message: dict[str, Any],
    known: dict[str, Instance],
    open_kv: Callable[[dict[str, Any]], Instance | None],
) -> list[InstanceEvent]:
    """Instance events of one watch message; a value that does not verify counts as the
    key's deletion (the owner puts its record back)."""
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
            inst = open_kv(ev["kv"])
            if inst is None:
                gone = known.pop(key, None)
                if gone is not None:
                    out.append(InstanceEvent(kind="removed", instance=gone))
                continue
            if key not in known:
                out.append(InstanceEvent(kind="added", instance=inst))
            known[key] = inst
    return out


def _reason(exc: BaseException) -> str:
    """Why a request to etcd failed, without aiohttp's connection-key repr."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        err = exc.os_error
        return f"{os.strerror(err.errno) if err.errno else err} (is etcd running there?)"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return repr(exc)
