"""The namespace harness itself (tests/support/netns.py): hosts reach each other over the bridge
but share neither /dev/shm nor /tmp, processes on one host share both, and everything is torn
down (processes by PID, namespaces, bridge) when the test body fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.support.netns import can_make_namespaces, cluster, kept_under_tmp

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

LISTEN = "import socket,sys; s=socket.create_server((sys.argv[1], 7000)); s.accept()"


def _ip_lines(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


def test_hosts_are_separate_and_torn_down_on_failure(tmp_path: Path) -> None:
    if (why := can_make_namespaces()) is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    with pytest.raises(RuntimeError, match="the test failed"), cluster(2, tmp_path) as c:
        a, b = c.hosts
        a.run("sh", "-c", "echo a > /dev/shm/mark && echo a > /tmp/mark")
        assert a.run("cat", "/dev/shm/mark") == "a\n"  # another process, same host
        # b sees neither of a's marks: nothing in /dev/shm, and in /tmp only the checkout it
        # keeps visible when that lives under /tmp (a CI clone)
        kept = {Path(k).relative_to("/tmp").parts[0] for k in kept_under_tmp()}
        assert b.run("ls", "-A", "/dev/shm") == ""
        assert set(b.run("ls", "-A", "/tmp").split()) == kept
        assert (tmp_path / "host0" / "tmp" / "mark").read_text() == "a\n"
        server = a.spawn("listener", [sys.executable, "-c", LISTEN, a.ip])
        b.run(sys.executable, "-c",
              f"import socket,time\nfor _ in range(100):\n  try:\n"
              f"    socket.create_connection(('{a.ip}', 7000), 1); break\n"
              f"  except OSError: time.sleep(0.05)\nelse: raise SystemExit(1)")  # fmt: skip
        pids = [server.pid, a.holder.pid, b.holder.pid]
        names, bridge = [h.netns for h in c.hosts], c.bridge
        raise RuntimeError("the test failed")
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}")  # killed and reaped
    listed = _ip_lines("netns", "list")
    assert not any(n in listed for n in names)
    assert bridge not in _ip_lines("-o", "link")
