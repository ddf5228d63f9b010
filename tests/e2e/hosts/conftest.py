"""Hosts for the multi-host suite: one set per session (tests/support/netns.py), etcd and NATS
on host0, the others free for each test's frontends and workers (each test uses its own
namespace, so what one leaves in etcd is no other's concern).

Skipped with the reason where network namespaces cannot be made (not root); under CI=true the
suite must run, so that is a failure instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from tests.support.netns import can_make_namespaces, cluster, start_etcd, start_nats
from tests.support.netns_tandem import Hosts

NUM_HOSTS = 5


@pytest.fixture(scope="session")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    why_not = can_make_namespaces()
    if why_not is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the multi-host suite must run in CI: {why_not}")
        pytest.skip(why_not)
    with cluster(NUM_HOSTS, tmp_path_factory.mktemp("hosts")) as c:
        _, etcd_url = start_etcd(c.hosts[0])
        _, nats_url = start_nats(c.hosts[0])
        yield Hosts(cluster=c, etcd_url=etcd_url, nats_url=nats_url)
