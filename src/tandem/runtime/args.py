"""Runtime flags, with `TANDEM_*` environment fallbacks; declared once, used by every command."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from tandem.runtime.config import DISCOVERY_BACKENDS, EVENT_BACKENDS, RuntimeConfig
from tandem.runtime.secret import read_secret_file

# flag -> (env var, help); defaults come from RuntimeConfig
_FLAGS: dict[str, tuple[str, str]] = {
    "namespace": ("TANDEM_NAMESPACE", "namespace of every endpoint path"),
    "discovery": ("TANDEM_DISCOVERY", f"discovery backend: {', '.join(DISCOVERY_BACKENDS)}"),
    "discovery_dir": ("TANDEM_DISCOVERY_DIR", "directory of instance records (file discovery)"),
    "etcd_url": ("TANDEM_ETCD_URL", "etcd client URL (etcd discovery)"),
    "events": ("TANDEM_EVENTS", f"event plane backend: {', '.join(EVENT_BACKENDS)}"),
    "nats_url": ("TANDEM_NATS_URL", "NATS server URL (nats events)"),
    "host": ("TANDEM_HOST_IP", "address the request-plane server binds and advertises"),
    "lease_ttl_s": ("TANDEM_LEASE_TTL_S", "seconds a dead process's records outlive it"),
    "cluster_secret": (
        "TANDEM_CLUSTER_SECRET",
        "shared secret that authenticates every request-plane, event-plane, transfer and "
        "file-discovery peer; give every process of a deployment the same one (visible in "
        "`ps` as a flag: prefer the env var or --cluster-secret-file)",
    ),
    "cluster_secret_file": (
        "TANDEM_CLUSTER_SECRET_FILE",
        "file holding the cluster secret (mode 600)",
    ),
    "max_frame_bytes": ("TANDEM_MAX_FRAME_BYTES", "request-plane frame size limit in bytes"),
    "stream_stall_timeout_s": (
        "TANDEM_STREAM_STALL_TIMEOUT_S",
        "a request-plane stream whose consumer reads nothing this long is cancelled",
    ),
}
_FLOATS = {"lease_ttl_s", "stream_stall_timeout_s"}
_INTS = {"max_frame_bytes"}


def add_runtime_args(parser: argparse.ArgumentParser) -> None:
    """Add --namespace --discovery --discovery-dir --etcd-url --events --nats-url --host
    --lease-ttl-s --cluster-secret --cluster-secret-file --max-frame-bytes
    --stream-stall-timeout-s. Unset flags fall back to the env var, then to RuntimeConfig's default.
    A flag the parser already has (e.g. `--host` of an HTTP server) is skipped; the runtime
    value then comes from its env var (TANDEM_HOST_IP) or the default."""
    group = parser.add_argument_group("runtime")
    for name, (env, help_) in _FLAGS.items():
        flag = "--" + name.replace("_", "-")
        if any(flag in a.option_strings for a in parser._actions):
            continue  # the command already owns this flag (e.g. --host of an HTTP server)
        group.add_argument(
            flag, dest=f"runtime_{name}", default=None, metavar=env, help=f"{help_} (env {env})"
        )


def runtime_config_from_args(
    ns: argparse.Namespace, env: Mapping[str, str] | None = None, **overrides: object
) -> RuntimeConfig:
    """Flags first, then `TANDEM_*` env vars, then defaults; `overrides` win over all."""
    environ = os.environ if env is None else env
    values: dict[str, object] = {}
    for name, (var, _) in _FLAGS.items():
        raw = getattr(ns, f"runtime_{name}", None)
        if raw is None:
            raw = environ.get(var)
        if raw is None or raw == "":
            continue
        values[name] = float(raw) if name in _FLOATS else int(raw) if name in _INTS else raw
    values.pop("cluster_secret_file", None)
    values.pop("cluster_secret", None)
    secret = resolve_cluster_secret(
        getattr(ns, "runtime_cluster_secret", None),
        getattr(ns, "runtime_cluster_secret_file", None),
        environ,
    )
    if secret is not None:
        values["cluster_secret"] = secret
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
            return value
    return None
