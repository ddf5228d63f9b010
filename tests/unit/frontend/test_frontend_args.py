"""Frontend flags: API keys from flags (or TANDEM_API_KEY) and a file; HTTP limits with env."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tandem.frontend.args import add_frontend_args, frontend_config_from_args
from tandem.runtime.flag_parser import parse_args


def _config(argv: list[str]) -> object:
    parser = argparse.ArgumentParser()
    add_frontend_args(parser)
    return frontend_config_from_args(parse_args(parser, argv))


def test_api_keys_from_flags_file_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_API_KEY", "env-1, env-2")
    assert _config([]).api_keys == ("env-1", "env-2")  # type: ignore[attr-defined]
    keys = tmp_path / "keys"
    keys.write_text("file-1\nfile-2,file-3\n\n")
    assert _config(["--api-key-file", str(keys)]).api_keys == (  # type: ignore[attr-defined]
        "env-1",
        "env-2",
        "file-1",
        "file-2",
        "file-3",
    )
    config = _config(["--api-key", "a", "--api-key", "b", "--admin-api-key", "adm"])
    assert config.api_keys == ("a", "b") and config.admin_api_keys == ("adm",)  # type: ignore[attr-defined]


def test_http_limits_from_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_HTTP_IDLE_TIMEOUT_S", "7")
    config = _config(["--http-max-connections", "50", "--http-header-timeout-s", "2"])
    http = config.http  # type: ignore[attr-defined]
    assert (http.max_connections, http.header_timeout_s, http.idle_timeout_s) == (50, 2.0, 7.0)
    with pytest.raises(ValueError, match="max_header_count=1 out of range"):
        _config(["--http-max-headers", "1"])
