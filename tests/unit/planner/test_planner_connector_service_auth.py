"""Workers a planner starts connect to etcd, NATS and their peers as the planner does: its
auth and TLS files go on their command line, its passwords and token only in their
environment (argv shows in `ps`)."""

from __future__ import annotations

from pathlib import Path

from tandem.planner.connector.local import runtime_flags, secret_env
from tandem.runtime.config import RuntimeConfig


def test_service_auth_and_tls_reach_the_workers(tmp_path: Path, monkeypatch) -> None:
    for var in ("TANDEM_ETCD_PASSWORD", "TANDEM_NATS_PASSWORD", "TANDEM_NATS_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    files = {}
    for name in ("ca", "cert", "key"):
        (tmp_path / name).write_text("x")
        files[name] = str(tmp_path / name)
    rc = RuntimeConfig(
        discovery="etcd", etcd_url="https://etcd:2379", events="nats", nats_url="tls://nats:4222",
        etcd_user="tandem", etcd_password="etcd-pw", etcd_ca_file=files["ca"],
        nats_user="tandem", nats_password="nats-pw", nats_ca_file=files["ca"],
        nats_cert_file=files["cert"], nats_key_file=files["key"],
        tls_cert_file=files["cert"], tls_key_file=files["key"], tls_ca_file=files["ca"],
        tls_require_client_cert=True,
    )  # fmt: skip
    flags = runtime_flags(rc)
    pairs = dict(zip(flags[::2], flags[1::2], strict=False))
    assert pairs["--etcd-user"] == "tandem" and pairs["--etcd-ca-file"] == files["ca"]
    assert pairs["--nats-cert-file"] == files["cert"] and pairs["--tls-ca-file"] == files["ca"]
    assert flags[-1] == "--tls-require-client-cert"
    assert "etcd-pw" not in flags and "nats-pw" not in flags
    assert secret_env(rc) == {"TANDEM_ETCD_PASSWORD": "etcd-pw", "TANDEM_NATS_PASSWORD": "nats-pw"}
    monkeypatch.setenv("TANDEM_NATS_PASSWORD", "inherited")
    assert secret_env(rc) == {"TANDEM_ETCD_PASSWORD": "etcd-pw"}


def test_plain_deployment_adds_nothing() -> None:
    rc = RuntimeConfig(discovery="file", events="zmq")
    assert not any(f.startswith(("--etcd-user", "--nats-", "--tls-")) for f in runtime_flags(rc))
