"""File discovery: one host, many processes, no service to run.

A directory holds one record per instance, `<instance_id>.json` (written to a temp file and
renamed, so readers never see half a record). The owner refreshes the file's mtime every
`ttl_s / 4` (heartbeat). A record is dead when its mtime is older than `ttl_s`, or at once
when it was written on this host by a process that no longer exists (pid + start time, so a
reused pid does not keep it alive; a process found alive is re-checked by its start time once
a second and by a signal-0 probe in between, ~1 µs instead of psutil's ~85: every watcher scans
every record 4 times a second). Readers delete dead records. Watchers poll the directory
every `poll_interval_s`, so adds and removals are seen within about that long.

The directory is private: created 0700, and refused when another user owns it or when group or
others may write to it (or to its parent, unless that is a sticky /tmp-like directory), since
whoever can write a record there receives the requests routed to it. With a cluster secret
each record carries an HMAC tag over its bytes; a record without a valid tag is ignored (and
logged once), so a forged record never becomes an instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import time
from collections.abc import AsyncIterator

import msgspec
import psutil

from tandem.protocols.discovery import Instance, InstanceEvent
from tandem.runtime.discovery.sealed import ForgedRecordError, seal, unseal
from tandem.runtime.secret import key_for
from tandem.runtime.task import cancel_and_wait

logger = logging.getLogger(__name__)
_HOST = socket.gethostname()


class FileRecord(msgspec.Struct, kw_only=True):
    instance: Instance
    host: str
    pid: int
    pid_start: float  # psutil create_time of the owner process


_PURPOSE = "file-discovery/v1"


def seal_record(record: FileRecord, key: bytes | None) -> bytes:
    return seal(msgspec.json.encode(record), key)


def open_record(data: bytes, key: bytes | None) -> FileRecord:
    return msgspec.json.decode(unseal(data, key), type=FileRecord)


def write_private(path: str, data: bytes) -> None:
    """Write `path` (mode 0600) through a temp file renamed over it: a reader in another
    process sees the old content or the new, never half of it."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def check_private_dir(directory: str) -> None:
    """Raise PermissionError unless `directory` is owned by this user and writable by no one
    else, and its parent lets no one else replace it."""
    me = os.geteuid()
    st = os.stat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"discovery directory {directory!r} is not a directory")
    if st.st_uid != me:
        raise PermissionError(
            f"discovery directory {directory!r} is owned by uid {st.st_uid}, not by this user "
            f"(uid {me}); whoever owns it can redirect requests: use a directory of your own "
            "(--discovery-dir)"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(
            f"discovery directory {directory!r} has mode {stat.S_IMODE(st.st_mode):o}: others "
            f"can write records into it; expected no group/other write (chmod 700 {directory})"
        )
    parent = os.path.dirname(os.path.abspath(directory))
    pst = os.stat(parent)
    shared = pst.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if pst.st_uid not in (me, 0) or (shared and not pst.st_mode & stat.S_ISVTX):
        raise PermissionError(
            f"the parent {parent!r} of discovery directory {directory!r} lets another user "
            f"replace it (owner uid {pst.st_uid}, mode {stat.S_IMODE(pst.st_mode):o}); "
            "use a directory under one you own"
        )


ALIVE_RECHECK_S = 1.0
MAX_ALIVE_CACHE = 4096  # processes remembered alive (records of one directory)


def _process_alive(pid: int, pid_start: float) -> bool:
    try:
        return bool(abs(psutil.Process(pid).create_time() - pid_start) < 1.0)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


class FileDiscovery:
    """Implements `Discovery` over a private directory (created 0700 if missing; raises
    PermissionError when it is not private, see `check_private_dir`)."""

    def __init__(
        self,
        directory: str,
        *,
        ttl_s: float = 2.0,
        poll_interval_s: float = 0.25,
        secret: str | None = None,
    ):
        self.directory, self.ttl_s, self.poll_interval_s = directory, ttl_s, poll_interval_s
        os.makedirs(directory, mode=0o700, exist_ok=True)
        check_private_dir(directory)
        self._key = key_for(secret, _PURPOSE) if secret else None
        self._owned: dict[str, bytes] = {}  # instance_id -> encoded record
        # (name, inode) -> parsed record, or None for a forged one (ignored, logged once)
        self._cache: dict[tuple[str, int], FileRecord | None] = {}
        self.num_forged = 0
        self._heartbeat: asyncio.Task[None] | None = None
        me = psutil.Process()
        self._me = (me.pid, me.create_time())
        self._alive: dict[tuple[int, float], float] = {}  # (pid, start) -> checked (monotonic)

    def _path(self, instance_id: str) -> str:
        if not instance_id or "/" in instance_id or instance_id.startswith("."):
            raise ValueError(f"instance_id {instance_id!r} cannot name a file")
        return os.path.join(self.directory, f"{instance_id}.json")

    async def register(self, instance: Instance) -> None:
        if instance.instance_id in self._scan(""):
            raise ValueError(f"instance_id {instance.instance_id!r} is already registered")
        record = FileRecord(instance=instance, host=_HOST, pid=self._me[0], pid_start=self._me[1])
        data = seal_record(record, self._key)
        self._write(instance.instance_id, data)
        self._owned[instance.instance_id] = data
        if self._heartbeat is None:
            self._heartbeat = asyncio.create_task(self._beat(), name="file-discovery-heartbeat")

    def _write(self, instance_id: str, data: bytes) -> None:
        write_private(self._path(instance_id), data)

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
                record = self._cache[key] if key in self._cache else self._read(entry.path)
            except (FileNotFoundError, msgspec.DecodeError):
                continue
            except ForgedRecordError as exc:
                self.num_forged += 1
                logger.warning("ignoring discovery record %s: %s", entry.path, exc)
                record = None
            self._cache[key] = record
            seen.add(key)
            if record is None:
                continue
            if self._is_dead(record, now - st.st_mtime):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                continue
            if record.instance.path.startswith(prefix):
                live[record.instance.instance_id] = record.instance
        self._cache = {k: v for k, v in self._cache.items() if k in seen}
        return live

    def _read(self, path: str) -> FileRecord:
        with open(path, "rb") as f:
            return open_record(f.read(), self._key)

    def _is_dead(self, record: FileRecord, age_s: float) -> bool:
        if record.instance.instance_id in self._owned:
            return False
        if age_s > self.ttl_s:
            return True
        return record.host == _HOST and not self._alive_here(record.pid, record.pid_start)

    def _alive_here(self, pid: int, pid_start: float) -> bool:
        """`_process_alive`, its yes cached for `ALIVE_RECHECK_S` behind a signal-0 probe: a
        process that exits is seen at once, a zombie or a reused pid within the recheck."""
        key, now = (pid, pid_start), time.monotonic()
        checked = self._alive.get(key)
        if checked is not None and now - checked < ALIVE_RECHECK_S:
            try:
                os.kill(pid, 0)
                return True
            except ProcessLookupError:
                del self._alive[key]
                return False
            except PermissionError:
                return True  # another user's live process (the start time was checked)
        alive = _process_alive(pid, pid_start)
        if alive:
            if len(self._alive) >= MAX_ALIVE_CACHE:
                self._alive.clear()
            self._alive[key] = now
        else:
            self._alive.pop(key, None)
        return alive

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
