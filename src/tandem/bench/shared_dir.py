"""Where the project's shared/ folder is: beside the repository (a checkout's ../shared).

`TANDEM_SHARED_DIR` overrides it (e.g. for an installed, non-editable package)."""

from __future__ import annotations

import os
from pathlib import Path

SHARED_DIR = os.environ.get("TANDEM_SHARED_DIR") or str(
    Path(__file__).resolve().parents[3].parent / "shared"
)
MOONCAKE_TRACE = os.path.join(SHARED_DIR, "data", "mooncake_synthetic_trace.jsonl")
DYNAMO_ANCHOR_DIR = os.path.join(SHARED_DIR, "anchors", "dynamo")
