"""Catalog records as files in the file-discovery directory (one host, many processes).

`<discovery dir>/catalog/<key, percent-quoted>.rec` holds one sealed record (mode 0600, written
to a temp file and renamed, so a reader sees the old record or the new one, never half). The
directory follows the discovery's rules: created 0700 and refused when it is not private.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import urllib.parse
from pathlib import Path

from tandem.runtime.catalog.base import Sealer, check_record
from tandem.runtime.discovery.file import check_private_dir, write_private
from tandem.runtime.discovery.sealed import seal

_SUFFIX = ".rec"


class FileRecordStore:
    """Implements `RecordStore` in `<discovery_dir>/catalog` (PermissionError when that
    directory is not private)."""

    def __init__(self, discovery_dir: str, *, secret: str | None = None) -> None:
        self.directory = os.path.join(discovery_dir, "catalog")
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        check_private_dir(self.directory)
        self._sealer = Sealer(secret)

    @property
    def where(self) -> str:
        return f"directory {self.directory}"

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, urllib.parse.quote(key, safe="") + _SUFFIX)

    async def get(self, key: str) -> bytes | None:
        try:
            data = await asyncio.to_thread(Path(self._path(key)).read_bytes)
        except FileNotFoundError:
            return None
        return self._sealer.open(key, data, self.where)

    async def put(self, key: str, value: bytes) -> None:
        check_record(key, value)
        sealed = seal(value, self._sealer.key, key.encode())
        await asyncio.to_thread(write_private, self._path(key), sealed)

    async def delete(self, key: str) -> bool:
        try:
            await asyncio.to_thread(os.unlink, self._path(key))
        except FileNotFoundError:
            return False
        return True

    async def items(self, prefix: str) -> dict[str, bytes]:
        found = await asyncio.to_thread(self._read_all, prefix)
        opened = {k: self._sealer.open(k, data, self.where) for k, data in found.items()}
        return {k: v for k, v in opened.items() if v is not None}

    def _read_all(self, prefix: str) -> dict[str, bytes]:
        found = {}
        for name in os.listdir(self.directory):
            if not name.endswith(_SUFFIX):
                continue  # a temp file being written
            key = urllib.parse.unquote(name.removesuffix(_SUFFIX))
            if key.startswith(prefix):
                with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
                    found[key] = Path(self.directory, name).read_bytes()
        return found
