"""Shared test fixtures. Port 0 everywhere; real etcd/nats-server come from the venv.

`etcd_server` / `nats_server` start the real binaries on free loopback ports (see
tests/support/services.py), wait until ready and yield a `Service` (`.url`, `.pid`, `.stop()`);
they are stopped by PID afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.services import Service, free_port, start_etcd, start_nats

__all__ = ["free_port"]


@pytest.fixture
def etcd_server(tmp_path: Path) -> Iterator[Service]:
    svc = start_etcd(tmp_path)
    try:
        yield svc
    finally:
        svc.stop()


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[Service]:
    svc = start_nats(tmp_path)
    try:
        yield svc
    finally:
        svc.stop()
