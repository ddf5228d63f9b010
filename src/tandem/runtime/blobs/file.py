"""Blobs as files in the file-discovery directory (one host, many processes).

`<discovery dir>/blobs/<sha256>.blob` holds the bytes (mode 0600, written to a temp file and
renamed); `<sha256>.<pid>-<start ms>.hold` marks each process that holds it. The directory
follows the records' rules: created 0700 and refused when it is not private
(`check_private_dir`). Records carry an HMAC tag under a cluster secret; a blob needs none:
its name is its sha256, checked on every read, and the name comes from a record whose tag was
checked, so an altered or swapped file is refused as corrupt. A blob goes when its last
holder closes its store, or, for holders that died, at the next put or close of any process
(a holder whose process is gone counts for nothing). Puts and sweeps take an exclusive
`flock` on the directory, so a sweep never deletes a blob another process is putting.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import psutil

from tandem.runtime.blobs.base import (
    BlobMissingError,
    blob_id,
    check_blob_id,
    check_size,
    verified,
)
from tandem.runtime.discovery.file import check_private_dir, write_private


def _alive(holder: str) -> bool:
    pid_text, _, start_text = holder.partition("-")
    try:
        pid, start_ms = int(pid_text), int(start_text)
        created_ms = float(psutil.Process(pid).create_time()) * 1000
        return abs(created_ms - start_ms) < 1000
    except (ValueError, psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


class FileBlobStore:
    """Implements `BlobStore` in `<discovery_dir>/blobs` (raises PermissionError when that
    directory is not private)."""

    def __init__(self, discovery_dir: str) -> None:
        self.directory = os.path.join(discovery_dir, "blobs")
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        check_private_dir(self.directory)
        me = psutil.Process()
        self._holder = f"{me.pid}-{int(me.create_time() * 1000)}"
        self._held: set[str] = set()

    @property
    def where(self) -> str:
        return f"directory {self.directory}"

    def _blob(self, sha: str) -> str:
        return os.path.join(self.directory, f"{sha}.blob")

    def _hold(self, sha: str) -> str:
        return os.path.join(self.directory, f"{sha}.{self._holder}.hold")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    async def put(self, data: bytes) -> str:
        sha = blob_id(check_size(data))
        await asyncio.to_thread(self._put, sha, data)
        self._held.add(sha)
        return sha

    def _put(self, sha: str, data: bytes) -> None:
        with self._locked():
            write_private(self._hold(sha), b"")
            path = self._blob(sha)
            try:
                intact = blob_id(Path(path).read_bytes()) == sha
            except FileNotFoundError:
                intact = False
            if not intact:
                write_private(path, data)
            self._sweep()

    async def get(self, sha256: str) -> bytes:
        path = self._blob(check_blob_id(sha256))
        try:
            data = await asyncio.to_thread(Path(path).read_bytes)
        except FileNotFoundError:
            raise BlobMissingError(f"blob {sha256[:16]}… is not in {self.where}") from None
        return verified(sha256, data, where=self.where)

    def _sweep(self) -> None:
        """Delete blobs (and holder marks) that no live process holds; under the lock."""
        holders: dict[str, bool] = {}
        blobs: list[str] = []
        for name in os.listdir(self.directory):
            if name.endswith(".blob"):
                blobs.append(name.removesuffix(".blob"))
            elif name.endswith(".hold"):
                sha, _, holder = name.removesuffix(".hold").partition(".")
                if _alive(holder):
                    holders[sha] = True
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(self.directory, name))
        for sha in blobs:
            if not holders.get(sha):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._blob(sha))

    async def close(self) -> None:
        if not self._held:
            return
        held, self._held = self._held, set()
        await asyncio.to_thread(self._release, held)

    def _release(self, held: set[str]) -> None:
        with self._locked():
            for sha in held:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._hold(sha))
            self._sweep()
