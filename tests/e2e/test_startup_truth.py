"""A stack that cannot start says so: non-zero exit, one clear line, and no "ready" before it
(issue 12). Also: env and config file reach a real `tandem serve`."""

from __future__ import annotations

import asyncio
import re
import socket
from pathlib import Path

import pytest
from tests.support.eventually import eventually
from tests.support.tandem_procs import http_request, start_tandem

pytestmark = pytest.mark.timeout(120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _finish(name: str, args: list[str], tmp_path: Path, timeout_s: float = 90) -> tuple[int, str]:
    proc = start_tandem(name, args, tmp_path)
    try:
        code = proc.proc.wait(timeout=timeout_s)
    finally:
        proc.stop(grace_s=0)
    return code, proc.log_path.read_text()


@pytest.mark.parametrize("planner", [[], ["--planner"]], ids=["fixed", "planner"])
def test_serve_on_a_busy_port_exits_before_ready(tmp_path: Path, planner: list[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = ["serve", "--engine", "mocker", "--port", str(port), "--speedup-ratio", "0"]
        code, log = _finish("serve-busy", [*args, *planner], tmp_path)
    assert code != 0, log
    assert f"tandem serve: error: cannot listen on http://127.0.0.1:{port}: " in log, log
    assert "Address already in use" in log
    assert not re.search(r"\bready\b", log) and "Traceback" not in log, log
    assert "started worker" not in log and "starting worker" not in log, log  # none started


def test_frontend_on_a_busy_port_exits(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, log = _finish("frontend-busy", ["frontend", "--http-port", str(port)], tmp_path)
    assert code != 0 and "tandem frontend: error: cannot listen on" in log, log


def test_worker_on_a_busy_system_port_exits_before_ready(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = ["worker", "--engine", "mocker", "--system-port", str(port)]
        code, log = _finish("worker-busy", args, tmp_path)
    assert code != 0
    assert f"tandem worker: error: cannot listen on --system-port http://127.0.0.1:{port}" in log
    assert not re.search(r"\bready\b", log) and "Traceback" not in log, log


@pytest.mark.parametrize("command", ["worker", "frontend"])
def test_unreachable_etcd_is_one_line_at_start(tmp_path: Path, command: str) -> None:
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    args = [command, "--etcd-url", url] + (["--engine", "mocker"] if command == "worker" else [])
    code, log = _finish(f"{command}-no-etcd", args, tmp_path, timeout_s=60)
    assert code != 0
    assert f"tandem {command}: error: etcd at {url} unreachable" in log
    assert "Connection refused" in log and "Traceback" not in log, log
    assert not re.search(r"\bready\b", log), log


def test_missing_model_file_exits_before_ready(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    code, log = _finish("worker-nomodel", ["worker", "--engine", "native", "--model",
                                          str(missing)], tmp_path)  # fmt: skip
    assert code != 0
    assert (
        f"tandem worker: error: native worker could not start: model '{missing}' not found" in log
    )
    assert not re.search(r"\bready\b", log) and "Traceback" not in log, log
    args = ["serve", "--engine", "native", "--model", str(missing)]
    code, log = _finish("serve-nomodel", [*args, "--port", str(_free_port())], tmp_path)
    assert code != 0, log
    assert "tandem serve: error: worker(s) exited before they were ready: worker0" in log, log
    assert "serve ready" not in log and "Traceback" not in log, log


def test_bad_env_value_names_flag_and_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANDEM_MIGRATION_LIMIT", "many")
    code, log = _finish("serve-badenv", ["serve", "--engine", "mocker"], tmp_path, timeout_s=30)
    assert code == 2
    assert "--migration-limit (from env TANDEM_MIGRATION_LIMIT): invalid int value 'many'" in log


def test_serve_takes_env_and_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = _free_port()
    config = tmp_path / "tandem.yaml"
    config.write_text(
        "engine: mocker\nworkers: 1\nhttp-port: 1\nserve:\n  max-fanout: 3\n"
        "worker:\n  speedup-ratio: 0\n  model-name: from-config\n"
    )
    monkeypatch.setenv("TANDEM_HTTP_PORT", str(port))  # env beats the file's 1
    serve = start_tandem("serve-config", ["serve", "--config", str(config)], tmp_path)
    try:
        serve.wait_log(r"tandem serve ready", timeout_s=60)

        def listed() -> bool:  # the worker read its section of the file
            return b"from-config" in http_request(f"http://127.0.0.1:{port}/v1/models")[2]

        asyncio.run(eventually(listed, timeout_s=30, poll_s=0.2))
    finally:
        serve.stop()
