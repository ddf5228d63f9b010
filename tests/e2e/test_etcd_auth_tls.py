"""tandem against an etcd that authenticates its clients: client certificates over TLS
(`--client-cert-auth`), and etcd users (`auth enable`, a tandem user with a role on the
`tandem/` prefix). The right credentials work (a worker registers and a watcher sees it, also
after etcd's auth token expired); wrong or missing ones fail at once with an error that names
what to fix, and `tandem worker` and `tandem frontend` exit at start saying so."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.support.certs import Pki, make_pki
from tests.support.services import Service, enable_etcd_auth, free_port, start_etcd
from tests.support.tandem_procs import start_tandem

from tandem.protocols.discovery import Instance
from tandem.runtime.discovery.etcd import EtcdAuth, EtcdAuthError, EtcdDiscovery

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]
USERS = {"root": "root-pw-5d1f", "tandem": "tandem-pw-9a3c"}


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path / "pki")


@pytest.fixture
def etcd_tls(tmp_path: Path, pki: Pki) -> Iterator[Service]:
    svc = start_etcd(tmp_path, pki=pki)
    try:
        yield svc
    finally:
        svc.stop()


@pytest.fixture
def etcd_users(tmp_path: Path) -> Iterator[Service]:
    # simple auth tokens live 1 s here (300 s by default), so the test sees one expire
    svc = start_etcd(tmp_path, extra=("--auth-token", "simple", "--auth-token-ttl", "1"))
    try:
        enable_etcd_auth(svc, USERS)
        yield svc
    finally:
        svc.stop()


def _instance(iid: str) -> Instance:
    return Instance(
        instance_id=iid, namespace="t", component="backend", endpoint="generate", address="h:1"
    )


async def _round_trip(url: str, auth: EtcdAuth) -> None:
    """Register with one client, see it from another's list and watch."""
    owner, reader = EtcdDiscovery(url, ttl_s=1, auth=auth), EtcdDiscovery(url, ttl_s=1, auth=auth)
    try:
        await owner.register(_instance("w1"))
        assert [i.instance_id for i in await reader.list_instances()] == ["w1"]
        events = reader.watch("t.backend")
        first = await asyncio.wait_for(anext(events), 5)
        assert first.instance.instance_id == "w1"
    finally:
        await owner.close()
        await reader.close()


async def test_client_certificates(etcd_tls: Service, pki: Pki) -> None:
    good = EtcdAuth(
        ca_file=str(pki.ca), cert_file=str(pki.client.cert), key_file=str(pki.client.key)
    )
    await _round_trip(etcd_tls.url, good)
    for auth, expected in (
        (EtcdAuth(ca_file=str(pki.ca)), "TLS with etcd .* failed"),  # no client certificate
        (
            EtcdAuth(
                ca_file=str(pki.ca),
                cert_file=str(pki.stranger.cert),
                key_file=str(pki.stranger.key),
            ),
            "TLS with etcd .* failed",
        ),
        (
            EtcdAuth(
                ca_file=str(pki.other_ca),
                cert_file=str(pki.client.cert),
                key_file=str(pki.client.key),
            ),
            "TLS with etcd .* failed.*--etcd-ca-file",
        ),
    ):
        d = EtcdDiscovery(etcd_tls.url, auth=auth)
        try:
            with pytest.raises(EtcdAuthError, match=expected):
                await d.register(_instance("w2"))
            with pytest.raises(EtcdAuthError):  # a watcher gives up too, it does not spin
                await asyncio.wait_for(anext(d.watch("t")), 10)
        finally:
            await d.close()
    with pytest.raises(ValueError, match="https://"):
        EtcdDiscovery(etcd_tls.url.replace("https", "http"), auth=good)


async def test_users_and_expired_tokens(etcd_users: Service) -> None:
    good = EtcdAuth(user="tandem", password=USERS["tandem"])
    owner, reader = (
        EtcdDiscovery(etcd_users.url, ttl_s=1, auth=good),
        EtcdDiscovery(etcd_users.url, ttl_s=1, auth=good),
    )
    try:
        await owner.register(_instance("w1"))
        await asyncio.sleep(2.5)  # every token issued so far has expired; keep-alive went on
        assert [i.instance_id for i in await reader.list_instances()] == ["w1"]
        await asyncio.sleep(2.5)
        assert [i.instance_id for i in await reader.list_instances()] == ["w1"]  # lease kept
    finally:
        await owner.close()
        await reader.close()
    for auth, expected in (
        (EtcdAuth(user="tandem", password="wrong"), "refused user 'tandem'.*--etcd-password"),
        (EtcdAuth(), "requires credentials.*no --etcd-user given"),
    ):
        d = EtcdDiscovery(etcd_users.url, auth=auth)
        try:
            with pytest.raises(EtcdAuthError, match=expected):
                await d.register(_instance("w2"))
        finally:
            await d.close()


def test_processes_start_with_the_right_certificates_and_not_without(
    tmp_path: Path, etcd_tls: Service, pki: Pki
) -> None:
    flags = ["--discovery", "etcd", "--etcd-url", etcd_tls.url, "--etcd-ca-file", str(pki.ca)]
    certs = ["--etcd-cert-file", str(pki.client.cert), "--etcd-key-file", str(pki.client.key)]
    worker = ["worker", "--engine", "mocker", *flags]
    good = start_tandem("good", [*worker, *certs], tmp_path)
    bad = start_tandem("bad", worker, tmp_path)
    front = start_tandem("front", ["frontend", "--port", str(free_port()), *flags], tmp_path)
    try:
        good.wait_log(r"worker ready: instance_id=", timeout_s=40)
        for proc in (bad, front):  # no client certificate: both exit at start, saying why
            assert proc.proc.wait(40) != 0
            assert "TLS with etcd" in proc.log() and "--etcd-cert-file" in proc.log()
    finally:
        for proc in (good, bad, front):
            proc.stop()
