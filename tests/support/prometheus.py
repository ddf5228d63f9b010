"""Prometheus from Debian (`apt-get install prometheus`: /usr/bin/promtool, /usr/bin/prometheus)
for the metrics tests: `promtool check metrics` on an exposition, and a real Prometheus server on
a free loopback port with a generated scrape config, stopped by PID.

`make test` installs the package (`make prometheus`); where it is truly absent the tests that
need it skip with `NO_PROMETHEUS`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.support.services import Service, _spawn, _wait_ready, free_port

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
NO_PROMETHEUS = "Debian's prometheus package is not installed (make prometheus)"
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason=f"no promtool: {NO_PROMETHEUS}")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None, reason=f"no prometheus: {NO_PROMETHEUS}"
)


def promtool_check(text: bytes) -> None:
    """`promtool check metrics` (syntax and lint: HELP, types, naming) must pass silently."""
    assert PROMTOOL is not None, NO_PROMETHEUS
    done = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text, capture_output=True, timeout=30, check=False
    )
    out = (done.stdout + done.stderr).decode(errors="replace")
    assert done.returncode == 0 and not out.strip(), f"promtool rc={done.returncode}: {out}"


def start_prometheus(
    workdir: Path,
    jobs: list[dict[str, Any]],
    *,
    scrape_interval_s: float = 0.5,
    timeout_s: float = 30.0,
) -> Service:
    """A Prometheus server scraping `jobs` (scrape_config dicts without the interval)."""
    assert PROMETHEUS is not None, NO_PROMETHEUS
    port = free_port()
    config = {
        "global": {"scrape_interval": f"{int(scrape_interval_s * 1000)}ms"},
        "scrape_configs": [
            {**job, "scrape_interval": f"{int(scrape_interval_s * 1000)}ms"} for job in jobs
        ],
    }
    path = workdir / "prometheus.yml"
    path.write_text(json.dumps(config))  # JSON is YAML
    argv = [
        PROMETHEUS,
        f"--config.file={path}",
        f"--storage.tsdb.path={workdir / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--web.enable-lifecycle",
    ]
    svc = _spawn("prometheus", argv, workdir / "prometheus.log", f"http://127.0.0.1:{port}")

    def ready() -> bool:
        with urllib.request.urlopen(f"{svc.url}/-/ready", timeout=1) as resp:
            return bool(resp.status == 200)

    _wait_ready(svc, ready, timeout_s)
    return svc


def query(prometheus: Service, expr: str, timeout_s: float = 5.0) -> list[dict[str, Any]]:
    """The result vector of an instant PromQL query (raises on a query error)."""
    url = f"{prometheus.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def targets_up(prometheus: Service) -> dict[str, str]:
    """scrape URL → health ('up', 'down', 'unknown') of every active target."""
    with urllib.request.urlopen(f"{prometheus.url}/api/v1/targets", timeout=5) as resp:
        body = json.loads(resp.read())
    return {t["scrapeUrl"]: t["health"] for t in body["data"]["activeTargets"]}


__all__ = [
    "NO_PROMETHEUS",
    "needs_prometheus",
    "needs_promtool",
    "promtool_check",
    "query",
    "start_prometheus",
    "targets_up",
]
