"""Runtime flags, declared once, used by every command (env and config: `flag_parser.py`)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from tandem.runtime.config import DISCOVERY_BACKENDS, EVENT_BACKENDS, RuntimeConfig
from tandem.runtime.secret import read_secret_file

# flag -> (type, help); defaults come from RuntimeConfig
_FLAGS: dict[str, tuple[type, str]] = {
    "namespace": (str, "namespace of every endpoint path"),
    "discovery": (str, "discovery backend"),
    "discovery_dir": (str, "directory of instance records (file discovery; none: per user)"),
    "etcd_url": (
        str,
        "etcd client URL (default http://127.0.0.1:2379); given without --discovery, it "
        "chooses etcd discovery",
    ),
    "events": (str, "event plane backend"),
    "nats_url": (
        str,
        "NATS server URL (default nats://127.0.0.1:4222); given without --events, it chooses "
        "nats events",
    ),
    "host": (
        str,
        "address the request-plane server and event publisher bind (0.0.0.0: every interface; "
        "the loopback default becomes the routable address when etcd/NATS are on another host)",
    ),
    "port": (int, "request-plane port (0: any free port; pin it to open it in a firewall)"),
    "events_port": (int, "ZMQ event publisher port (zmq events; 0: any free port)"),
    "advertise_host": (
        str,
        "address other hosts dial to reach this process (default: this host's address on the "
        "route to etcd/NATS, else the bound address; never 0.0.0.0)",
    ),
    "lease_ttl_s": (float, "seconds a dead process's records outlive it"),
    "cluster_secret": (
        str,
        "shared secret that authenticates every request-plane, event-plane, transfer and "
        "file-discovery peer; give every process of a deployment the same one (visible in "
        "`ps` as a flag: prefer the env variable or --cluster-secret-file)",
    ),
    "cluster_secret_file": (str, "file holding the cluster secret (mode 600)"),
    "etcd_user": (str, "etcd user (etcd auth enabled; with --etcd-password)"),
    "etcd_password": (str, "password of --etcd-user (prefer the env variable: flags show in `ps`)"),
    "etcd_ca_file": (str, "CA certificate that signed etcd's server certificate (https:// URL)"),
    "etcd_cert_file": (
        str,
        "client certificate for etcd --client-cert-auth (with --etcd-key-file)",
    ),
    "etcd_key_file": (str, "private key of --etcd-cert-file"),
    "nats_user": (str, "NATS user (with --nats-password)"),
    "nats_password": (str, "password of --nats-user (prefer the env variable: flags show in `ps`)"),
    "nats_token": (str, "NATS authorization token (prefer the env variable)"),
    "nats_creds_file": (str, "NATS credentials file (.creds: user JWT + nkey seed)"),
    "nats_nkey_seed_file": (str, "file holding a NATS nkey user seed (SU...)"),
    "nats_ca_file": (str, "CA certificate that signed the NATS server's certificate (tls:// URL)"),
    "nats_cert_file": (str, "client certificate for NATS TLS verify (with --nats-key-file)"),
    "nats_key_file": (str, "private key of --nats-cert-file"),
    "tls_cert_file": (
        str,
        "this process's request-plane TLS certificate (PEM; with --tls-key-file and --tls-ca-file)",
    ),
    "tls_key_file": (str, "private key of --tls-cert-file"),
    "tls_ca_file": (
        str,
        "CA that signed every request-plane peer's certificate (TLS on when given)",
    ),
    "tls_require_client_cert": (
        bool,
        "request-plane servers require and verify a client certificate (mutual TLS)",
    ),
    "max_frame_bytes": (int, "request-plane frame size limit in bytes"),
    "stream_stall_timeout_s": (
        float,
        "a request-plane stream whose consumer reads nothing this long is cancelled",
    ),
}
_CHOICES = {"discovery": DISCOVERY_BACKENDS, "events": EVENT_BACKENDS}
# None unless given (flag, env or config file): a URL given chooses its backend
_NO_DEFAULT = ("cluster_secret", "etcd_url", "nats_url")


def add_runtime_args(parser: argparse.ArgumentParser) -> None:
    """Add --namespace --discovery --discovery-dir --etcd-url --events --nats-url --host
    --lease-ttl-s --cluster-secret --cluster-secret-file, etcd's and NATS's own auth and TLS
    (--etcd-user ... --nats-key-file), request-plane TLS (--tls-cert-file --tls-key-file
    --tls-ca-file --tls-require-client-cert), --max-frame-bytes --stream-stall-timeout-s, with
    RuntimeConfig's defaults. A flag the parser already has
    (e.g. `--host` of an HTTP server) is skipped; the runtime value then is the default."""
    group = parser.add_argument_group("runtime")
    defaults = RuntimeConfig()
    for name, (kind, help_) in _FLAGS.items():
        flag = "--" + name.replace("_", "-")
        if any(flag in a.option_strings for a in parser._actions):
            if name not in ("host", "port"):
                continue  # the command already owns this flag
            flag = f"--runtime-{name}"  # --host/--port are HTTP's: the runtime's get their own
        if kind is bool:
            group.add_argument(flag, dest=f"runtime_{name}", action="store_true", help=help_)
            continue
        group.add_argument(
            flag,
            dest=f"runtime_{name}",
            type=kind,
            choices=_CHOICES.get(name),
            default=None if name in _NO_DEFAULT else getattr(defaults, name, None),
            help=help_,
        )


def runtime_config_from_args(ns: argparse.Namespace, **overrides: object) -> RuntimeConfig:
    """The flags' values (env and config file included: `flag_parser.py`); `overrides` win."""
    values: dict[str, object] = {}
    for name in _FLAGS:
        raw = getattr(ns, f"runtime_{name}", None)
        if raw is not None and raw != "":
            values[name] = raw
    values.pop("cluster_secret_file", None)
    values.pop("cluster_secret", None)
    secret = resolve_cluster_secret(
        getattr(ns, "runtime_cluster_secret", None) or None,
        getattr(ns, "runtime_cluster_secret_file", None) or None,
        {},
    )
    if secret is not None:
        values["cluster_secret"] = secret
    # `tandem worker --etcd-url URL --nats-url URL` on its own host means etcd and NATS: the
    # in-process defaults (memory) would leave it alone, unseen by every frontend
    if "etcd_url" in values and values.get("discovery", "memory") == "memory":
        values["discovery"] = "etcd"
    if "nats_url" in values and values.get("events", "memory") == "memory":
        values["events"] = "nats"
    values.update(overrides)
    return RuntimeConfig(**values)  # type: ignore[arg-type]


def resolve_cluster_secret(
    secret: str | None, secret_file: str | None, env: Mapping[str, str]
) -> str | None:
    """The cluster secret from `--cluster-secret` or `--cluster-secret-file`, else from
    TANDEM_CLUSTER_SECRET or TANDEM_CLUSTER_SECRET_FILE; None when none is given. Two sources
    at the same level are an error (which one was meant?)."""
    for value, path, where in (
        (secret, secret_file, "--cluster-secret and --cluster-secret-file"),
        (
            env.get("TANDEM_CLUSTER_SECRET") or None,
            env.get("TANDEM_CLUSTER_SECRET_FILE") or None,
            "TANDEM_CLUSTER_SECRET and TANDEM_CLUSTER_SECRET_FILE",
        ),
    ):
        if value is not None and path is not None:
            raise ValueError(f"both {where} are set; give the cluster secret one way")
        if path is not None:
            return read_secret_file(path)
        if value is not None:
            return value.strip()  # a Secret made from `openssl rand -hex 32 > file` ends in \n
    return None
