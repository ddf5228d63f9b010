"""kvbm flags → `KvbmConfig` (env TANDEM_KVBM_* and config-file values:
`tandem.runtime.flag_parser`).

An engine that supports tiers calls `add_kvbm_args(parser)` in its own `add_args` and
`kvbm_config_from_args(args)` in its `config_from_args`; None means "no tiers configured".
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from tandem.kvbm.base import KvbmConfig

# flag (without --kvbm-) → (config field, type, help)
_FLAGS: tuple[tuple[str, str, Callable[[str], Any], str], ...] = (
    ("host-gb", "host_gb", float, "G2 host memory for offloaded KV blocks, in GiB"),
    ("host-blocks", "host_blocks", int, "G2 capacity in blocks (instead of --kvbm-host-gb)"),
    ("disk-dir", "disk_dir", str, "G3 directory for KV block files (owned by this worker)"),
    ("disk-gb", "disk_gb", float, "G3 disk space for KV block files, in GiB"),
    ("disk-blocks", "disk_blocks", int, "G3 capacity in blocks (instead of --kvbm-disk-gb)"),
    (
        "disk-min-reuse",
        "disk_min_reuse",
        int,
        "write a block to disk once reused this many times (0 = every block; default 1)",
    ),
    ("offload-queue", "offload_queue_size", int, "pending G1→G2 copies before skipping"),
    ("disk-queue", "disk_queue_size", int, "pending G2→G3 writes before skipping"),
    ("log-interval-s", "log_interval_s", float, "seconds between summary log lines (0 = off)"),
    ("hit-rate-window-s", "hit_rate_window_s", float, "sliding window of the hit-rate metrics"),
)


def add_kvbm_args(parser: argparse.ArgumentParser) -> None:
    """Add `--kvbm-*` flags; unset (None) ones keep KvbmConfig's defaults."""
    group = parser.add_argument_group("kv block manager (host and disk tiers)")
    for flag, _, kind, help_text in _FLAGS:
        group.add_argument(f"--kvbm-{flag}", type=kind, default=None, help=help_text)
    group.add_argument(
        "--kvbm-no-direct-io",
        action="store_true",
        help="buffered disk I/O instead of O_DIRECT",
    )


def kvbm_config_from_args(args: argparse.Namespace, *, block_bytes: int = 0) -> KvbmConfig | None:
    """The config the flags describe, or None when no host tier was asked for.
    Raises ValueError (naming the field) on inconsistent flags."""
    values: dict[str, Any] = {}
    for flag, name, _, _ in _FLAGS:
        value = getattr(args, "kvbm_" + flag.replace("-", "_"), None)
        if value is not None:
            values[name] = value
    if getattr(args, "kvbm_no_direct_io", False):
        values["disk_direct_io"] = False
    config = KvbmConfig(block_bytes=block_bytes, **values)
    if not config.has_host:
        return None
    return config


def with_block_bytes(config: KvbmConfig, block_bytes: int) -> KvbmConfig:
    """`config` with the engine's block size in bytes filled in (capacity in GB needs it)."""
    return dataclasses.replace(config, block_bytes=block_bytes)
