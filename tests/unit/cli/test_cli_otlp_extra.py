"""`--otlp-endpoint` (or OTEL_EXPORTER_OTLP_ENDPOINT) where the tracing extra is not installed:
every command that takes it exits at argument parsing with status 2 and a message naming the
extra to install, no traceback. Each command runs in its own interpreter in which importing
`opentelemetry` fails, as in a plain `pip install tandem`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tandem.runtime.tracing import INSTALL_HINT, missing_extra

pytestmark = pytest.mark.timeout(120)

ENDPOINT = "http://127.0.0.1:4318"
# a meta path finder that refuses opentelemetry, then the tandem CLI
WITHOUT_OTEL = """
import sys
class NoOpenTelemetry:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, NoOpenTelemetry())
from tandem.cli.main import main
sys.exit(main(sys.argv[1:]))
"""
COMMANDS = {
    "serve": ["serve", "--engine", "mocker", "--port", "0"],
    "frontend": ["frontend", "--port", "0"],
    "worker": ["worker", "--engine", "mocker"],
    "router": ["router"],
}


def test_the_extra_is_importable_in_the_dev_venv() -> None:
    assert missing_extra() is None  # make venv installs it (.[dev]); the e2e tracing tests need it


def test_every_command_refuses_the_endpoint_naming_the_extra() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TANDEM_"))}
    runs = {
        name: _run([*argv, "--otlp-endpoint", ENDPOINT], env) for name, argv in COMMANDS.items()
    }
    # the endpoint from OpenTelemetry's own variable is refused the same way
    runs["frontend (env)"] = _run(
        COMMANDS["frontend"], {**env, "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}
    )
    for name, proc in runs.items():
        try:
            _, err = proc.communicate(timeout=90)
        finally:
            proc.kill()
        assert proc.returncode == 2, (name, err[-2000:])
        assert "Traceback" not in err, (name, err[-2000:])
        assert f"--otlp-endpoint {ENDPOINT} needs the tracing extra" in err, (name, err)
        assert "opentelemetry" in err and INSTALL_HINT in err, (name, err)


def _run(argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", WITHOUT_OTEL, *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
