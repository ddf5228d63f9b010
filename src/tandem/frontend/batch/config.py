"""`BatchConfig`: the batch lane's knobs (`/v1/files`, `/v1/batches`, the runner), and their
flags (`tandem frontend` / `tandem serve`, env `TANDEM_BATCH_*`)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from tandem.config_check import check_range


def default_db_path() -> Path:
    """`$XDG_STATE_HOME/tandem/batches.sqlite` (else `~/.local/state/tandem/...`)."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(state) / "tandem" / "batches.sqlite"


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchConfig:
    """`db_path` None: an in-memory database (embedded use and tests; nothing outlives the
    process); `tandem frontend` defaults to `default_db_path()`."""

    db_path: Path | None = None
    max_file_bytes: int = 100 << 20
    max_lines: int = 50_000
    max_inflight: int = 8  # lines of all batches in flight at once
    max_attempts: int = 5  # a line whose request fails retryably (5xx, 429) runs again
    lease_s: float = 15.0  # a batch whose runner stopped renewing for this long is taken over
    poll_s: float = 0.5

    def __post_init__(self) -> None:
        check_range("max_file_bytes", self.max_file_bytes, low=1024, high=1 << 34)
        check_range("max_lines", self.max_lines, low=1, high=1_000_000)
        check_range("max_inflight", self.max_inflight, low=1, high=4096)
        check_range("max_attempts", self.max_attempts, low=1, high=100)
        check_range("lease_s", self.lease_s, low=0.5, high=3600.0)
        check_range("poll_s", self.poll_s, low=0.01, high=60.0)


def add_batch_args(parser: argparse.ArgumentParser) -> None:
    d = BatchConfig()
    env = os.environ.get
    g = parser.add_argument_group("batch lane (/v1/files, /v1/batches)")
    g.add_argument(
        "--batch-db",
        default=env("TANDEM_BATCH_DB", str(default_db_path())),
        metavar="PATH",
        help="SQLite file of uploaded files, batches and their results; they outlive a restart "
        "and a restarted frontend resumes unfinished batches; frontends of one host may share "
        "it; ':memory:' keeps nothing (env TANDEM_BATCH_DB; default %(default)s)",
    )
    g.add_argument(
        "--batch-max-file-mb",
        type=float,
        default=float(env("TANDEM_BATCH_MAX_FILE_MB", d.max_file_bytes / (1 << 20))),
        help="largest file POST /v1/files takes (413 above; the request body limit "
        "--max-body-bytes applies first) (env TANDEM_BATCH_MAX_FILE_MB)",
    )
    g.add_argument(
        "--batch-max-inflight",
        type=int,
        default=int(env("TANDEM_BATCH_MAX_INFLIGHT", d.max_inflight)),
        metavar="N",
        help="batch lines in flight at once; lines run at the lowest priority class (batch) "
        "and none starts while a model's router has requests queued "
        "(env TANDEM_BATCH_MAX_INFLIGHT)",
    )


def batch_config_from_args(ns: argparse.Namespace) -> BatchConfig:
    path = ns.batch_db
    return BatchConfig(
        db_path=None if path in (None, "", ":memory:") else Path(path),
        max_file_bytes=int(ns.batch_max_file_mb * (1 << 20)),
        max_inflight=ns.batch_max_inflight,
    )
