"""`--mm-*` frontend flags → ImageConfig, validated once."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tandem.multimodal.args import add_image_args, image_config_from_args
from tandem.multimodal.config import ImageConfig
from tandem.runtime.flag_parser import parse_args


def _parse(argv: list[str]) -> ImageConfig:
    parser = argparse.ArgumentParser()
    add_image_args(parser)
    return image_config_from_args(parse_args(parser, argv))


def test_defaults_allow_data_urls_only() -> None:
    cfg = _parse([])
    assert cfg.allowed_local_dir is None and cfg.allowed_hosts == ()
    assert not cfg.allow_private_hosts and cfg == ImageConfig()


def test_flags_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_MM_MAX_IMAGES_PER_REQUEST", "2")
    argv = ["--mm-allowed-local-dir", str(tmp_path), "--mm-allowed-hosts", "A.example, b.example"]
    cfg = _parse([*argv, "--mm-max-image-bytes", "1000", "--mm-fetch-timeout-s", "2.5"])
    assert cfg.allowed_local_dir == tmp_path and cfg.allowed_hosts == ("a.example", "b.example")
    assert (cfg.max_image_bytes, cfg.max_images_per_request, cfg.fetch_timeout_s) == (1000, 2, 2.5)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("max_image_bytes", 0, "max_image_bytes=0 out of range; expected >= 1"),
        ("max_images_per_request", -1, "max_images_per_request=-1 out of range"),
        ("fetch_timeout_s", 0.0, "fetch_timeout_s=0.0 out of range; expected > 0"),
        ("allowed_local_dir", Path("/nonexistent/dir"), "is not a directory"),
        ("allowed_hosts", ("http://a.example/",), "expected a lower-case host name"),
    ],
)
def test_bad_values_name_the_field(field: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ImageConfig(**{field: value})  # type: ignore[arg-type]
