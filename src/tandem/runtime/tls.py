"""TLS for the request plane: the contexts a process's server and client use.

One identity per process (`--tls-cert-file`, `--tls-key-file`: it serves with it and presents
it as a client) and one CA that signed every peer's certificate (`--tls-ca-file`). Clients
verify the server's certificate and its name (the host of the address they dial, so a
certificate names the addresses workers advertise as IP SANs); servers ask for and verify the
client's certificate only with `--tls-require-client-cert` (mutual TLS). The cluster secret's
challenge-response still runs inside TLS: TLS hides and protects the bytes, the secret
proves membership.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsFiles:
    """PEM files of one process's TLS identity and the CA it trusts."""

    cert_file: str
    key_file: str
    ca_file: str
    require_client_cert: bool = False

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.ca_file)
        ctx.load_cert_chain(self.cert_file, self.key_file)
        ctx.verify_mode = ssl.CERT_REQUIRED if self.require_client_cert else ssl.CERT_NONE
        return ctx

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca_file)
        ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx
