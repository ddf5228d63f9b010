"""DESIGN.md §2: imports flow down the package table. Engines implement the handoff
contract (`tandem.engines.handoff`) but never import `tandem.disagg` or anything above it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tandem.engines.handoff as handoff

pytestmark = pytest.mark.timeout(10)
SRC = Path(handoff.__file__).resolve().parents[1]  # src/tandem
ABOVE_ENGINES = ("tandem.router", "tandem.disagg", "tandem.multimodal", "tandem.frontend",
                 "tandem.planner", "tandem.bench", "tandem.cli")  # fmt: skip


def imported_modules(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_no_engine_module_imports_a_package_above_engines() -> None:
    files = sorted((SRC / "engines").rglob("*.py"))
    assert any(f.name == "kv_transfer.py" for f in files)  # the walk sees the handoffs
    bad = [
        f"{f.relative_to(SRC)} imports {name}"
        for f in files
        for name in imported_modules(f)
        if name.startswith(ABOVE_ENGINES)
    ]
    assert bad == []
