"""The request plane over TLS on loopback (throw-away CA from tests/support/certs.py): a TLS
client that trusts the CA streams as over plaintext, with the cluster secret's handshake inside;
a plaintext client, a client trusting another CA and (with mutual TLS) a client whose
certificate another CA signed are refused, each with a message that says why."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.support.certs import Pki, make_pki

from tandem import errors
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.tcp import StreamContext, TcpRequestClient, TcpRequestServer
from tandem.runtime.tls import TlsFiles

pytestmark = pytest.mark.timeout(30)
SECRET = secrets.token_hex(32)


async def echo_n(payload: bytes, ctx: StreamContext) -> AsyncIterator[bytes]:
    for i in range(int(payload)):
        yield b"%d" % i


def _files(pki: Pki, *, client: str = "client", ca: Path | None = None, mutual: bool = False):
    pair = {"server": pki.server, "client": pki.client, "stranger": pki.stranger}[client]
    return TlsFiles(cert_file=str(pair.cert), key_file=str(pair.key),
                    ca_file=str(ca or pki.ca), require_client_cert=mutual)  # fmt: skip


async def _serve(pki: Pki, *, mutual: bool) -> TcpRequestServer:
    srv = TcpRequestServer(
        secret=SECRET,
        handshake_timeout_s=1,
        ssl_context=_files(pki, client="server", mutual=mutual).server_context(),
    )
    srv.register("ns.c.echo", echo_n)
    await srv.start()
    return srv


async def _ask(srv: TcpRequestServer, ssl_files: TlsFiles | None) -> list[bytes]:
    ctx = ssl_files.client_context() if ssl_files is not None else None
    client = TcpRequestClient(connect_timeout_s=2, secret=SECRET, ssl_context=ctx)
    try:
        stream = client.stream(srv.address, "ns.c.echo", b"5", request_id="r1")
        return [x async for x in stream]
    finally:
        await client.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
async def test_tls_client_streams(pki: Pki, mutual: bool) -> None:
    srv = await _serve(pki, mutual=mutual)
    try:
        assert await _ask(srv, _files(pki)) == [b"0", b"1", b"2", b"3", b"4"]
    finally:
        await srv.stop(grace_s=0)


async def test_plaintext_and_untrusting_clients_are_refused(pki: Pki) -> None:
    srv = await _serve(pki, mutual=True)
    try:
        with pytest.raises(
            errors.PeerGone,
            match=r"is the server using TLS\? then this process needs --tls-ca-file",
        ):
            await _ask(srv, None)
        with pytest.raises(errors.PeerGone, match=r"TLS failed.*CERTIFICATE_VERIFY_FAILED"):
            await _ask(srv, _files(pki, ca=pki.other_ca))
        with pytest.raises(errors.PeerGone, match=r"TLS failed|closed|reset"):
            await _ask(srv, _files(pki, client="stranger"))  # mutual: unknown client CA
        assert await _ask(srv, _files(pki)) == [b"0", b"1", b"2", b"3", b"4"]
    finally:
        await srv.stop(grace_s=0)


async def test_tls_client_refused_by_a_plaintext_server(pki: Pki) -> None:
    srv = TcpRequestServer(secret=SECRET, handshake_timeout_s=1)
    srv.register("ns.c.echo", echo_n)
    await srv.start()
    try:
        with pytest.raises(errors.PeerGone, match=r"TLS failed|closed"):
            await _ask(srv, _files(pki))
    finally:
        await srv.stop(grace_s=0)


def test_tls_options_go_together(pki: Pki) -> None:
    with pytest.raises(ValueError, match="tls_cert_file, tls_key_file and tls_ca_file together"):
        RuntimeConfig(tls_cert_file=str(pki.client.cert), tls_key_file=str(pki.client.key))
    with pytest.raises(ValueError, match="tls_require_client_cert needs"):
        RuntimeConfig(tls_require_client_cert=True)
    files = {"tls_cert_file": str(pki.client.cert), "tls_key_file": str(pki.client.key),
             "tls_ca_file": str(pki.ca)}  # fmt: skip
    assert RuntimeConfig(**files).tls == _files(pki)
