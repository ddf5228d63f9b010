"""KvbmConfig validation and capacity resolution; --kvbm-* flags and env fallbacks."""

from __future__ import annotations

import argparse

import pytest

from tandem.kvbm.args import add_kvbm_args, kvbm_config_from_args, with_block_bytes
from tandem.kvbm.base import GIB, KvbmConfig
from tandem.runtime.flag_parser import parse_args


def test_capacity_by_blocks_or_by_gb() -> None:
    assert KvbmConfig(host_blocks=7).host_capacity_blocks() == 7
    config = KvbmConfig(host_gb=1.0, block_bytes=GIB // 8)
    assert config.host_capacity_blocks() == 8
    assert config.host_capacity_blocks(slot_bytes=GIB // 4) == 4


def test_gb_capacity_needs_block_bytes() -> None:
    with pytest.raises(ValueError, match="block_bytes"):
        KvbmConfig(host_gb=1.0).host_capacity_blocks()


def test_gb_too_small_for_one_block_is_rejected() -> None:
    with pytest.raises(ValueError, match="holds no block"):
        KvbmConfig(host_gb=0.5, block_bytes=GIB).host_capacity_blocks()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"host_gb": 1.0, "host_blocks": 4}, "host_gb and host_blocks both set"),
        ({"host_blocks": -1}, "host_blocks=-1 out of range"),
        ({"host_blocks": 4, "disk_blocks": 4}, "disk_dir=None"),
        ({"host_blocks": 4, "disk_dir": "/tmp/x"}, "without disk_gb or disk_blocks"),
        ({"disk_dir": "/tmp/x", "disk_blocks": 4}, "without a host tier"),
        ({"host_blocks": 4, "offload_queue_size": 0}, "offload_queue_size=0 out of range"),
    ],
)
def test_invalid_config_names_the_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KvbmConfig(**kwargs)  # type: ignore[arg-type]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_kvbm_args(parser)
    return parse_args(parser, argv)


def test_flags_build_config(tmp_path: object) -> None:
    argv = "--kvbm-host-blocks 64 --kvbm-disk-gb 2 --kvbm-disk-min-reuse 0"
    argv += " --kvbm-offload-queue 8 --kvbm-no-direct-io"
    args = _parse([*argv.split(), "--kvbm-disk-dir", str(tmp_path)])
    config = kvbm_config_from_args(args, block_bytes=4096)
    assert config is not None
    assert config.host_capacity_blocks() == 64
    assert config.disk_capacity_blocks() == 2 * GIB // 4096
    assert (config.disk_min_reuse, config.offload_queue_size) == (0, 8)
    assert config.disk_direct_io is False


def test_no_host_flag_means_no_tiers() -> None:
    assert kvbm_config_from_args(_parse([])) is None


def test_env_is_the_fallback_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_KVBM_HOST_GB", "3")
    config = kvbm_config_from_args(_parse([]), block_bytes=GIB)
    assert config is not None and config.host_gb == 3.0
    config = kvbm_config_from_args(_parse(["--kvbm-host-gb", "5"]), block_bytes=GIB)
    assert config is not None and config.host_gb == 5.0


def test_with_block_bytes_fills_in_the_engine_size() -> None:
    config = with_block_bytes(KvbmConfig(host_gb=1.0), GIB // 2)
    assert config.host_capacity_blocks() == 2
