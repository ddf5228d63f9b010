"""deploy/: the Kubernetes manifests render with `kubectl kustomize` and validate against the
Kubernetes schemas (kubernetes-validate, offline); every tandem container's flags and the
ConfigMap's tandem.yaml parse with tandem's own parsers; probes and graceful termination are
wired to /live, /health and the drain; the systemd unit says what the README says; the tandem
containers run the image name `make image` tags. The image built and run:
tests/e2e/test_image.py (marker `image`, `make test-image`)."""

from __future__ import annotations

import argparse
import base64
import re
import secrets
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tandem.runtime.args import resolve_cluster_secret
from tandem.runtime.flag_parser import load_config_file, parse_args
from tandem.runtime.secret import check_secret

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
SECRET_FILE = "cluster-secret.txt"  # the operator makes it: openssl rand -hex 32


def _kustomize(tree: Path) -> subprocess.CompletedProcess[str]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (Debian: apt-get install kubernetes-client)")
    return subprocess.run([kubectl, "kustomize", str(tree)], capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def _committed_tree(tmp: Path) -> Path:
    """deploy/k8s as committed: without the operator's gitignored cluster-secret.txt."""
    tree = tmp / "k8s"
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns(SECRET_FILE))
    return tree


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tree = _committed_tree(tmp_path_factory.mktemp("k8s"))
    (tree / SECRET_FILE).write_text(secrets.token_hex(32) + "\n")  # as the README tells
    out = _kustomize(tree)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def test_manifests_as_committed_require_a_real_secret(
    rendered: list[dict[str, Any]], tmp_path: Path
) -> None:
    out = _kustomize(_committed_tree(tmp_path))
    assert out.returncode != 0 and SECRET_FILE in out.stderr  # no placeholder rendered
    assert SECRET_FILE in (REPO / ".gitignore").read_text()
    (secret,) = [d for d in rendered if d["kind"] == "Secret"]
    value = base64.b64decode(secret["data"]["secret"]).decode()
    env = {"TANDEM_CLUSTER_SECRET": value}
    assert resolve_cluster_secret(None, None, env) == value.strip()
    check_secret(value.strip())  # what every tandem container gets through its env
    for pod in _deployments(rendered).values():
        refs = [e["valueFrom"]["secretKeyRef"]["name"] for c in pod["containers"]
                for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})]  # fmt: skip
        assert refs == [secret["metadata"]["name"]]


def test_manifests_validate_against_the_kubernetes_schemas(rendered: list[dict[str, Any]]) -> None:
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    for doc in rendered:
        kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError
    kinds = {(d["kind"], d["metadata"]["name"]) for d in rendered}
    for name in ("tandem-frontend", "tandem-worker", "tandem-prefill", "tandem-decode",
                 "tandem-encoder", "nats"):  # fmt: skip
        assert ("Deployment", name) in kinds
    assert ("StatefulSet", "etcd") in kinds and ("Service", "tandem-frontend") in kinds
    assert any(k == "ConfigMap" and n.startswith("tandem-config") for k, n in kinds)


def _deployments(rendered: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        d["metadata"]["name"]: d["spec"]["template"]["spec"]
        for d in rendered
        if d["kind"] == "Deployment" and d["metadata"]["name"].startswith("tandem-")
    }


def _config(rendered: list[dict[str, Any]], tmp_path: Path) -> Path:
    (cm,) = [d for d in rendered if d["kind"] == "ConfigMap"]
    path = tmp_path / "tandem.yaml"
    path.write_text(cm["data"]["tandem.yaml"])
    return path


def _parser(args: list[str]) -> argparse.ArgumentParser:
    from tandem.cli.worker import add_arguments as worker_args
    from tandem.frontend.main import add_arguments as frontend_args

    command = args[0]
    parser = argparse.ArgumentParser(prog=f"tandem {command}")
    if command == "frontend":
        frontend_args(parser)
    else:
        worker_args(parser, args[1:])
    return parser


def test_every_container_parses_its_flags_and_the_config(
    rendered: list[dict[str, Any]], tmp_path: Path
) -> None:
    config = _config(rendered, tmp_path)
    env = {"TANDEM_CONFIG": str(config), "TANDEM_HOST": "10.0.0.5"}
    for name, pod in _deployments(rendered).items():
        (container,) = pod["containers"]
        args = container["args"]
        names = {e["name"] for e in container["env"]}
        assert {"TANDEM_CONFIG", "TANDEM_CLUSTER_SECRET"} <= names, name
        ns = parse_args(_parser(args), args[1:], env)  # exits 2 on an unknown or bad key
        assert ns.runtime_discovery == "etcd" and ns.runtime_events == "nats", name
        assert container["resources"]["requests"], name
        grace = pod["terminationGracePeriodSeconds"]
        drain = ns.http_drain_grace_s if args[0] == "frontend" else ns.drain_grace_s
        assert grace > drain + 5, f"{name}: grace {grace}s leaves no room for a {drain}s drain"
        if args[0] == "worker":
            assert "TANDEM_HOST" in names, f"{name}: others must dial the pod IP"
            assert container["ports"][0]["containerPort"] == ns.system_port, name
            assert container["livenessProbe"]["httpGet"]["path"] == "/live", name
            assert container["readinessProbe"]["httpGet"]["path"] == "/health", name


def test_frontend_probes_and_drain(rendered: list[dict[str, Any]], tmp_path: Path) -> None:
    (container,) = _deployments(rendered)["tandem-frontend"]["containers"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/live"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    values = load_config_file(str(_config(rendered, tmp_path)), "frontend")
    assert values["http-host"] == "0.0.0.0"  # reachable from the Service
    assert container["ports"][0]["containerPort"] == values["http-port"]


def test_systemd_unit_uses_the_config_file_and_drains_on_stop() -> None:
    unit = (REPO / "deploy" / "systemd" / "tandem.service").read_text()
    config = REPO / "deploy" / "systemd" / "tandem.yaml"
    assert "--config /etc/tandem/tandem.yaml" in unit and "KillSignal=SIGTERM" in unit
    stop_s = int(re.search(r"TimeoutStopSec=(\d+)", unit).group(1))  # type: ignore[union-attr]
    from tandem.cli.serve import build_parser

    ns = parse_args(build_parser(), ["--config", str(config)], {})
    assert ns.engine == "native" and ns.host == "0.0.0.0"
    assert stop_s > ns.http_drain_grace_s + 12  # frontend drain, then the workers' 10 s + 2
    assert load_config_file(str(config), "worker")["drain-grace-s"] <= 10


def test_tandem_containers_run_the_image_the_build_tags(rendered: list[dict[str, Any]]) -> None:
    built = subprocess.run(
        ["bash", str(REPO / "deploy" / "image" / "build.sh"), "name"],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout.strip()  # fmt: skip
    version = re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M)
    assert version and built == f"localhost/tandem:{version.group(1)}"
    pods = _deployments(rendered)
    assert len(pods) == 5
    for name, pod in pods.items():
        (container,) = pod["containers"]
        assert container["image"] == built, name


def test_dockerfile_pins_the_makefile_torch_and_checks_health() -> None:
    """The fast half; tests/e2e/test_image.py runs what the Dockerfile builds."""
    text = (REPO / "Dockerfile").read_text()
    (torch,) = set(re.findall(r"torch==([\d.]+)", (REPO / "Makefile").read_text()))
    assert f"ARG TORCH_VERSION={torch}\n" in text
    assert re.search(r"^HEALTHCHECK .*\n.*/health'", text, re.M)
    assert re.search(r"^USER tandem$", text, re.M)
