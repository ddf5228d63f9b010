from __future__ import annotations

import argparse
import secrets

import pytest

from tandem.runtime.args import add_runtime_args, runtime_config_from_args
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.flag_parser import parse_args
from tandem.runtime.registry import make_discovery, make_event_bus


def test_defaults_are_embedded_backends() -> None:
    cfg = RuntimeConfig()
    assert (cfg.discovery, cfg.events, cfg.host) == ("memory", "memory", "127.0.0.1")


def test_unknown_backend_names_the_choices() -> None:
    with pytest.raises(
        ValueError, match="unknown discovery 'consul'; expected one of: etcd, file, memory"
    ):
        RuntimeConfig(discovery="consul")
    with pytest.raises(
        ValueError, match="unknown event bus 'kafka'; expected one of: memory, nats, zmq"
    ):
        RuntimeConfig(events="kafka")


def test_out_of_range_names_field_and_range() -> None:
    with pytest.raises(
        ValueError, match=r"lease_ttl_s=0.1 out of range; expected 0.5 <= lease_ttl_s <= 3600"
    ):
        RuntimeConfig(lease_ttl_s=0.1)


def test_flags_beat_env_which_beats_defaults() -> None:
    env = {"TANDEM_DISCOVERY": "etcd", "TANDEM_EVENTS": "nats", "TANDEM_NAMESPACE": "dev"}
    cfg = runtime_config_from_args(_parse("--discovery", "file", "--lease-ttl-s", "3", env=env))
    assert (cfg.discovery, cfg.events, cfg.namespace, cfg.lease_ttl_s) == (
        "file",
        "nats",
        "dev",
        3.0,
    )


def test_existing_host_flag_is_left_to_the_command() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="0.0.0.0")
    add_runtime_args(parser)
    ns = parse_args(parser, ["--host", "10.0.0.1"], {"TANDEM_HOST_IP": "10.1.1.1"})
    assert ns.host == "10.0.0.1"
    assert runtime_config_from_args(ns).host == "127.0.0.1"


def test_registry_builds_memory_backends() -> None:
    cfg = RuntimeConfig()
    disc = make_discovery(cfg)
    assert type(disc).__name__ == "MemoryDiscovery"
    assert type(make_event_bus(cfg, disc)).__name__ == "MemoryEventBus"


SECRET = secrets.token_hex(32)  # as `openssl rand -hex 32` makes one


def _parse(*argv: str, env: dict[str, str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_runtime_args(parser)
    return parse_args(parser, list(argv), env or {})


def test_cluster_secret_from_flag_file_or_env(tmp_path) -> None:
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    assert runtime_config_from_args(_parse("--cluster-secret", SECRET)).cluster_secret == SECRET
    from_file = runtime_config_from_args(_parse("--cluster-secret-file", str(path)))
    assert from_file.cluster_secret == SECRET
    env = {"TANDEM_CLUSTER_SECRET_FILE": str(path)}
    assert runtime_config_from_args(_parse(env=env)).cluster_secret == SECRET
    # no secret anywhere means no authentication
    assert runtime_config_from_args(_parse()).cluster_secret is None


def test_cluster_secret_never_printed_and_checked(tmp_path) -> None:
    assert SECRET not in repr(RuntimeConfig(cluster_secret=SECRET))
    with pytest.raises(ValueError, match="too short"):
        RuntimeConfig(cluster_secret="short")
    path = tmp_path / "secret"
    path.write_text(SECRET)
    path.chmod(0o644)
    with pytest.raises(ValueError, match=r"mode 644.*chmod 600"):
        runtime_config_from_args(_parse("--cluster-secret-file", str(path)))
    with pytest.raises(ValueError, match="give the cluster secret one way"):
        runtime_config_from_args(
            _parse("--cluster-secret", SECRET, "--cluster-secret-file", str(path))
        )
    with pytest.raises(ValueError, match="give the cluster secret one way"):  # flag + env
        env = {"TANDEM_CLUSTER_SECRET_FILE": str(path)}
        runtime_config_from_args(_parse("--cluster-secret", SECRET, env=env))


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("replace-me-with-the-output-of-openssl-rand-hex-32", "contains 'replace'"),
        ("CHANGEME-please-0123456789abcdef0123", "contains 'changeme'"),
        ("an-example-value-for-the-docs-0123456789", "contains 'example'"),
        ("placeholder-0123456789abcdef0123456789", "contains 'placeholder'"),
        ("my-cluster-secret-0123456789abcdef0123", "contains 'secret'"),
        ("a" * 64, "only 1 distinct characters"),
        ("abcab" * 8, "only 3 distinct characters"),
        ("a" * 56 + "bcdefghi", "bits of entropy per character"),
        ("0123456789abcdef" * 4, "repeats a 16-character pattern"),
        # a fresh random value under a fixed id: pytest-xdist workers must collect equal ids
        pytest.param(secrets.token_hex(8), "too short", id="16 random hex digits-too short"),
    ],
)
def test_placeholder_and_low_entropy_secrets_are_refused(value: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as info:
        RuntimeConfig(cluster_secret=value)
    assert "openssl rand -hex 32" in str(info.value)


def test_real_random_secrets_always_pass() -> None:
    import base64

    from tandem.runtime.secret import check_secret

    for _ in range(2_000):  # hex as `openssl rand -hex 16|32`, base64 as `-base64 24|32`
        check_secret(secrets.token_hex(16))
        check_secret(secrets.token_hex(32))
        check_secret(base64.b64encode(secrets.token_bytes(24)).decode())
        check_secret(base64.b64encode(secrets.token_bytes(32)).decode())
