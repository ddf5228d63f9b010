"""File discovery: one host, many processes, no service to run.

A directory holds one record per instance, `<instance_id>.json` (written to a temp file and
renamed, so readers never see half a record). The owner refreshes the file's mtime every
`ttl_s / 4` (heartbeat). A record is dead when its mtime is older than `ttl_s`, or at once
when it was written on this host by a process that no longer exists (pid + start time, so a
reused pid does not keep it alive). Readers delete dead records. Watchers poll the directory
every `poll_interval_s`, so adds and removals are seen within about that long.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import AsyncIterator

import msgspec
import psutil

from tandem.protocols.discovery import Instance, InstanceEvent
from tandem.runtime.task import cancel_and_wait

logger = logging.getLogger(__name__)
_HOST = socket.gethostname()


class FileRecord(msgspec.Struct, kw_only=True):
    instance: Instance
    host: str
    pid: int
    pid_start: float  # psutil create_time of the owner process


def _process_alive(pid: int, pid_start: float) -> bool:
    try:
        return bool(abs(psutil.Process(pid).create_time() - pid_start) < 1.0)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


class FileDiscovery:
    """Implements `Discovery` over a shared directory (created if missing)."""

    def __init__(self, directory: str, *, ttl_s: float = 2.0, poll_interval_s: float = 0.25):
        self.directory, self.ttl_s, self.poll_interval_s = directory, ttl_s, poll_interval_s
        os.makedirs(directory, exist_ok=True)
        self._owned: dict[str, bytes] = {}  # instance_id -> encoded record
        self._cache: dict[tuple[str, int], FileRecord] = {}  # (name, inode) -> parsed
        self._heartbeat: asyncio.Task[None] | None = None
        me = psutil.Process()
        self._me = (me.pid, me.create_time())

    def _path(self, instance_id: str) -> str:
        if not instance_id or "/" in instance_id or instance_id.startswith("."):
            raise ValueError(f"instance_id {instance_id!r} cannot name a file")
        return os.path.join(self.directory, f"{instance_id}.json")

    async def register(self, instance: Instance) -> None:
        if instance.instance_id in self._scan(""):
            raise ValueError(f"instance_id {instance.instance_id!r} is already registered")
        record = FileRecord(instance=instance, host=_HOST, pid=self._me[0], pid_start=self._me[1])
        data = msgspec.json.encode(record)
        self._write(instance.instance_id, data)
        self._owned[instance.instance_id] = data
        if self._heartbeat is None:
            self._heartbeat = asyncio.create_task(self._beat(), name="file-discovery-heartbeat")

    def _write(self, instance_id: str, data: bytes) -> None:
        path = self._path(instance_id)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    async def unregister(self, instance_id: str) -> None:
        self._owned.pop(instance_id, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(instance_id))

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 4)
            for instance_id, data in list(self._owned.items()):
                try:
                    os.utime(self._path(instance_id))
                except FileNotFoundError:  # a reader expired us (we were late): come back
                    logger.warning("record of instance_id=%s was expired; rewriting", instance_id)
                    self._write(instance_id, data)
                except OSError:
                    logger.exception("heartbeat of instance_id=%s failed", instance_id)

    def _scan(self, prefix: str) -> dict[str, Instance]:
        """Live instances under `prefix` by id; deletes dead records it meets."""
        live: dict[str, Instance] = {}
        now, seen = time.time(), set()
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return live
        for entry in entries:
            if not entry.name.endswith(".json"):
                continue
            try:
                st = entry.stat()
                key = (entry.name, st.st_ino)
                record = self._cache.get(key) or self._read(entry.path)
            except (FileNotFoundError, msgspec.DecodeError):
                continue
            self._cache[key] = record
            seen.add(key)
            if self._is_dead(record, now - st.st_mtime):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                continue
            if record.instance.path.startswith(prefix):
                live[record.instance.instance_id] = record.instance
        self._cache = {k: v for k, v in self._cache.items() if k in seen}
        return live

    @staticmethod
    def _read(path: str) -> FileRecord:
        with open(path, "rb") as f:
            return msgspec.json.decode(f.read(), type=FileRecord)

    def _is_dead(self, record: FileRecord, age_s: float) -> bool:
        if record.instance.instance_id in self._owned:
            return False
        if age_s > self.ttl_s:
            return True
        return record.host == _HOST and not _process_alive(record.pid, record.pid_start)

    async def list_instances(self, prefix: str = "") -> list[Instance]:
        return list(self._scan(prefix).values())

    async def watch(self, prefix: str = "") -> AsyncIterator[InstanceEvent]:
        known: dict[str, Instance] = {}
        while True:
            current = self._scan(prefix)
            for iid, inst in current.items():
                if iid not in known:
                    yield InstanceEvent(kind="added", instance=inst)
            for iid, inst in known.items():
                if iid not in current:
                    yield InstanceEvent(kind="removed", instance=inst)
            known = current
            await asyncio.sleep(self.poll_interval_s)

    async def close(self) -> None:
        await cancel_and_wait([self._heartbeat])
        self._heartbeat = None
        for instance_id in list(self._owned):
            await self.unregister(instance_id)
