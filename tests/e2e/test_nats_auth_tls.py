"""tandem's NATS event bus against a nats-server that authenticates its clients: a user and
password, a token, an nkey (made here with the `nkeys` package), and TLS that verifies client
certificates. The right credentials publish and subscribe; missing or wrong ones fail at the
first connect with NatsConnectError naming the URL, the options given and the server's
reason, and `tandem frontend` exits at start saying so."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import nkeys
import pytest
from tests.support.certs import Pki, make_pki
from tests.support.services import Service, free_port, start_nats
from tests.support.tandem_procs import start_tandem

from tandem.runtime.events.nats import NatsAuth, NatsConnectError, NatsEventBus

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]
PASSWORD = "nats-pw-7c2e"
TOKEN = "nats-token-41f0a9"


async def _round_trip(url: str, auth: NatsAuth) -> None:
    bus = NatsEventBus(url, auth=auth, connect_timeout_s=3)
    try:
        sub = await bus.subscribe("t.kv_events")
        await bus.publish("t.kv_events", b"hello")
        got = await asyncio.wait_for(anext(aiter(sub)), 5)
        assert got == ("t.kv_events", b"hello")
    finally:
        await bus.close()


async def _refused(url: str, auth: NatsAuth, reason: str) -> str:
    bus = NatsEventBus(url, auth=auth, connect_timeout_s=3)
    try:
        with pytest.raises(NatsConnectError, match=reason) as info:
            await bus.publish("t.kv_events", b"x")
        assert url in str(info.value)
        return str(info.value)
    finally:
        await bus.close()


def _nkey_user(tmp_path: Path) -> tuple[str, str]:
    """(public key, path of a file holding its seed)."""
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    path = tmp_path / "user.nk"
    path.write_bytes(seed)
    path.chmod(0o600)
    return public, str(path)


def _started(tmp_path: Path, config: str) -> Service:
    return start_nats(tmp_path, config=config)


Case = Callable[[Path], tuple[str, NatsAuth, NatsAuth]]


def _user(tmp_path: Path) -> tuple[str, NatsAuth, NatsAuth]:
    conf = f'authorization {{ user: tandem, password: "{PASSWORD}" }}'
    return conf, NatsAuth(user="tandem", password=PASSWORD), NatsAuth(user="tandem", password="no")


def _token(tmp_path: Path) -> tuple[str, NatsAuth, NatsAuth]:
    return f'authorization {{ token: "{TOKEN}" }}', NatsAuth(token=TOKEN), NatsAuth()


def _nkey(tmp_path: Path) -> tuple[str, NatsAuth, NatsAuth]:
    public, seed_file = _nkey_user(tmp_path)
    (tmp_path / "stranger").mkdir()
    _, stranger = _nkey_user(tmp_path / "stranger")  # a key the server does not know
    conf = f"authorization {{ users = [ {{ nkey: {public} }} ] }}"
    return conf, NatsAuth(nkey_seed_file=seed_file), NatsAuth(nkey_seed_file=stranger)


@pytest.mark.parametrize("case", [_user, _token, _nkey], ids=["user", "token", "nkey"])
async def test_credentials(tmp_path: Path, case: Case) -> None:
    conf, good, bad = case(tmp_path)
    svc = _started(tmp_path, conf)
    try:
        await _round_trip(svc.url, good)
        await _refused(svc.url, bad, "[Aa]uthorization")
        await _refused(svc.url, NatsAuth(), "[Aa]uthorization")
    finally:
        svc.stop()


async def test_tls_with_client_certificates(tmp_path: Path) -> None:
    pki: Pki = make_pki(tmp_path / "pki")
    conf = (
        f'tls {{ cert_file: "{pki.server.cert}", key_file: "{pki.server.key}", '
        f'ca_file: "{pki.ca}", verify: true, timeout: 3 }}'
    )
    svc = _started(tmp_path, conf)
    try:
        assert svc.url.startswith("tls://")
        client = {"cert_file": str(pki.client.cert), "key_file": str(pki.client.key)}
        await _round_trip(svc.url, NatsAuth(ca_file=str(pki.ca), **client))
        # the server's certificate is not trusted: the client refuses it
        await _refused(svc.url, NatsAuth(ca_file=str(pki.other_ca), **client), "CERTIFICATE")
        # no client certificate (or one from another CA): the server refuses the client
        await _refused(svc.url, NatsAuth(ca_file=str(pki.ca)), "CERTIFICATE_REQUIRED")
        stranger = {"cert_file": str(pki.stranger.cert), "key_file": str(pki.stranger.key)}
        await _refused(svc.url, NatsAuth(ca_file=str(pki.ca), **stranger), "UNKNOWN_CA")
    finally:
        svc.stop()


def test_frontend_starts_with_the_password_and_not_without(tmp_path: Path) -> None:
    svc = _started(tmp_path, f'authorization {{ user: tandem, password: "{PASSWORD}" }}')
    flags = ["--discovery", "file", "--discovery-dir", str(tmp_path / "disc"), "--events",
             "nats", "--nats-url", svc.url]  # fmt: skip
    good = start_tandem(
        "good",
        ["frontend", "--port", str(free_port()), *flags, "--nats-user", "tandem"],
        tmp_path,
        env={"TANDEM_NATS_PASSWORD": PASSWORD},
    )
    bad = start_tandem("bad", ["frontend", "--port", str(free_port()), *flags], tmp_path)
    try:
        good.wait_log(r"frontend listening on", timeout_s=40)
        assert bad.proc.wait(40) != 0
        assert "cannot connect to NATS" in bad.log() and "Authorization" in bad.log()
    finally:
        good.stop()
        bad.stop()
        svc.stop()
