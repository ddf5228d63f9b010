from __future__ import annotations

import asyncio
import os
import secrets
import stat
import time
from pathlib import Path

import psutil
import pytest

from tandem.protocols.discovery import Instance
from tandem.runtime.discovery.file import FileDiscovery, FileRecord, seal_record

pytestmark = pytest.mark.timeout(15)


def inst(iid: str, component: str = "backend") -> Instance:
    return Instance(
        instance_id=iid,
        namespace="t",
        component=component,
        endpoint="generate",
        address="127.0.0.1:1",
    )


async def test_two_clients_see_each_other(tmp_path: Path) -> None:
    a, b = FileDiscovery(str(tmp_path)), FileDiscovery(str(tmp_path))
    await a.register(inst("a"))
    await b.register(inst("b", "prefill"))
    assert {i.instance_id for i in await b.list_instances()} == {"a", "b"}
    assert [i.instance_id for i in await b.list_instances("t.backend")] == ["a"]
    with pytest.raises(ValueError, match="already registered"):
        await b.register(inst("a"))
    await a.close()
    assert [i.instance_id for i in await b.list_instances()] == ["b"]
    await b.close()
    assert os.listdir(tmp_path) == []


async def test_watch_sees_adds_and_removes(tmp_path: Path) -> None:
    a, b = FileDiscovery(str(tmp_path), poll_interval_s=0.02), FileDiscovery(str(tmp_path))
    await b.register(inst("first"))
    events = a.watch("t.backend")
    assert (await anext(events)).instance.instance_id == "first"
    await b.register(inst("second"))
    ev = await asyncio.wait_for(anext(events), 2)
    assert (ev.kind, ev.instance.instance_id) == ("added", "second")
    await b.unregister("first")
    ev = await asyncio.wait_for(anext(events), 2)
    assert (ev.kind, ev.instance.instance_id) == ("removed", "first")
    await events.aclose()
    await b.close()


def _write_foreign(tmp_path: Path, iid: str, *, host: str, pid: int, age_s: float) -> Path:
    record = FileRecord(instance=inst(iid), host=host, pid=pid, pid_start=0.0)
    path = tmp_path / f"{iid}.json"
    path.write_bytes(seal_record(record, None))
    old = time.time() - age_s
    os.utime(path, (old, old))
    return path


async def test_stale_heartbeat_expires_and_is_deleted(tmp_path: Path) -> None:
    fresh = _write_foreign(tmp_path, "fresh", host="elsewhere", pid=1, age_s=0.0)
    stale = _write_foreign(tmp_path, "stale", host="elsewhere", pid=1, age_s=5.0)
    d = FileDiscovery(str(tmp_path), ttl_s=2.0)
    assert [i.instance_id for i in await d.list_instances()] == ["fresh"]
    assert fresh.exists() and not stale.exists()


async def test_dead_pid_on_this_host_expires_at_once(tmp_path: Path) -> None:
    import socket

    # pid_start=0.0 never matches a live process's start time: the writer is gone
    _write_foreign(tmp_path, "ghost", host=socket.gethostname(), pid=os.getpid(), age_s=0.0)
    d = FileDiscovery(str(tmp_path), ttl_s=60.0)
    assert await d.list_instances() == []


def test_a_live_writer_is_checked_cheaply_and_its_exit_seen_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scans (4 a second per watcher) re-check a writer found alive by a signal-0 probe, not
    psutil's start time, until the recheck is due; a writer that exits is dead at the very
    next scan."""
    import socket
    import subprocess
    import sys

    from tandem.runtime.discovery import file

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        record = FileRecord(instance=inst("w"), host=socket.gethostname(), pid=child.pid,
                            pid_start=psutil.Process(child.pid).create_time())  # fmt: skip
        (tmp_path / "w.json").write_bytes(seal_record(record, None))
        calls = []
        real = file._process_alive
        monkeypatch.setattr(file, "_process_alive", lambda *a: calls.append(a) or real(*a))
        d = FileDiscovery(str(tmp_path), ttl_s=60.0)
        for _ in range(20):
            assert [i.instance_id for i in asyncio.run(d.list_instances())] == ["w"]
        assert len(calls) == 1  # one start-time check; the other 19 scans probed by signal
    finally:
        child.kill()
        child.wait()
    assert asyncio.run(d.list_instances()) == []
    assert not (tmp_path / "w.json").exists()


async def test_heartbeat_keeps_record_alive_past_ttl(tmp_path: Path) -> None:
    owner = FileDiscovery(str(tmp_path), ttl_s=0.5)
    other = FileDiscovery(str(tmp_path), ttl_s=0.5)
    await owner.register(inst("a"))
    path = tmp_path / "a.json"
    first = path.stat().st_mtime
    for _ in range(60):  # a file's mtime has no event to wait on
        if path.stat().st_mtime != first:
            break
        await asyncio.sleep(0.05)
    assert path.stat().st_mtime != first, "heartbeat never refreshed the record"
    assert [i.instance_id for i in await other.list_instances()] == ["a"]
    await owner.close()


SECRET = secrets.token_hex(32)  # as `openssl rand -hex 32` makes one


async def test_forged_record_is_ignored_and_logged_once(tmp_path: Path, caplog) -> None:
    import logging
    import socket

    caplog.set_level(logging.WARNING, logger="tandem.runtime.discovery.file")
    real = FileDiscovery(str(tmp_path), secret=SECRET)
    await real.register(inst("real"))
    # a process without the secret writes a record that would take the requests of t.backend
    forged = FileRecord(instance=inst("evil"), host=socket.gethostname(), pid=os.getpid(),
                        pid_start=psutil.Process().create_time())  # fmt: skip
    (tmp_path / "evil.json").write_bytes(seal_record(forged, None))
    reader = FileDiscovery(str(tmp_path), secret=SECRET)
    for _ in range(3):
        assert [i.instance_id for i in await reader.list_instances()] == ["real"]
    assert reader.num_forged == 1
    assert caplog.text.count("ignoring discovery record") == 1
    assert (tmp_path / "evil.json").exists()  # ignored, not ours to delete
    # a reader without the secret would have believed it
    assert {i.instance_id for i in await FileDiscovery(str(tmp_path)).list_instances()} == {
        "real",
        "evil",
    }
    await real.close()


async def test_directory_is_created_private(tmp_path: Path) -> None:
    directory = tmp_path / "fresh" / "discovery"
    FileDiscovery(str(directory))
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o770, 0o777, 0o720])
def test_directory_writable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    directory = tmp_path / "shared"
    directory.mkdir()
    directory.chmod(mode)
    with pytest.raises(PermissionError, match=f"mode {mode:o}: others can write"):
        FileDiscovery(str(directory))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_directory_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "theirs"
    directory.mkdir(mode=0o700)
    os.chown(directory, 65534, 65534)
    with pytest.raises(PermissionError, match="owned by uid 65534, not by this user"):
        FileDiscovery(str(directory))
