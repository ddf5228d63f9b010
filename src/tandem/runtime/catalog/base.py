"""The `RecordStore` protocol: small named records that outlive the process that wrote them,
kept where the cluster's discovery keeps its instances (memory, the file-discovery directory,
etcd keys), so every process of a deployment reads the same ones.

Unlike an instance record a catalog record has no lease: it stays until someone deletes it (an
adapter loaded through one frontend is still there when that frontend restarts). With a cluster
secret each record is sealed (`runtime/discovery/sealed.py`: an HMAC tag over its key and bytes),
and one that does not verify is ignored as if absent and logged once.
"""

from __future__ import annotations

import logging
from typing import Protocol

from tandem.runtime.discovery.sealed import ForgedRecordError, unseal
from tandem.runtime.secret import key_for

logger = logging.getLogger(__name__)

PURPOSE = "catalog/v1"  # the secret's key for catalog records is its own (secret.key_for)
MAX_RECORD_BYTES = 64 << 10
MAX_KEY_CHARS = 512


class RecordStore(Protocol):
    """Records by key (a `/`-separated path). Safe to use from one asyncio event loop."""

    @property
    def where(self) -> str:
        """Where the records are kept, for messages."""
        ...

    async def get(self, key: str) -> bytes | None:
        """The record at `key`; None when there is none (or it does not verify)."""
        ...

    async def put(self, key: str, value: bytes) -> None:
        """Write (or replace) the record at `key`. Raises ValueError over the size limits."""
        ...

    async def delete(self, key: str) -> bool:
        """Remove the record at `key`; whether there was one."""
        ...

    async def items(self, prefix: str) -> dict[str, bytes]:
        """Every record whose key starts with `prefix` (those that do not verify left out)."""
        ...


def check_record(key: str, value: bytes) -> None:
    if not key or len(key) > MAX_KEY_CHARS:
        raise ValueError(f"catalog key of {len(key)} characters; expected 1 to {MAX_KEY_CHARS}")
    if len(value) > MAX_RECORD_BYTES:
        raise ValueError(
            f"catalog record of {len(value)} bytes exceeds the limit of {MAX_RECORD_BYTES}"
        )


class Sealer:
    """Seals and opens records under the cluster secret (no tag without one); logs a record
    that does not verify once per key."""

    def __init__(self, secret: str | None) -> None:
        self.key = key_for(secret, PURPOSE) if secret else None
        self._logged: set[str] = set()
        self.num_forged = 0

    def open(self, key: str, data: bytes, where: str) -> bytes | None:
        try:
            return unseal(data, self.key, key.encode())
        except (ForgedRecordError, ValueError) as exc:  # msgspec.DecodeError is a ValueError
            self.num_forged += 1
            if key not in self._logged and len(self._logged) < 4096:
                self._logged.add(key)
                logger.warning("ignoring catalog record %r in %s: %s", key, where, exc)
            return None
