"""The build files (Makefile, Dockerfile, the image script, CI) import tandem modules by name in
shell strings that no import checker sees: every `from tandem.x import name` and
`-m tandem.x` there must name a module that exists, so a move inside src/ cannot leave the
image build or `make venv` importing a path that is gone."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD_FILES = ("Makefile", "Dockerfile", "deploy/image/build.sh", ".ci/run")
FROM_IMPORT = re.compile(r"from (tandem(?:\.\w+)*) import (\w+)")
DASH_M = re.compile(r"-m (tandem(?:\.\w+)+)")


def named_modules(text: str) -> list[tuple[str, str | None]]:
    found: list[tuple[str, str | None]] = [(m, n) for m, n in FROM_IMPORT.findall(text)]
    found += [(m, None) for m in DASH_M.findall(text)]
    return found


def test_the_pattern_finds_what_the_files_write() -> None:
    text = 'python -c "from tandem.a.b import c; x" && python -m tandem.cli.main serve'
    assert named_modules(text) == [("tandem.a.b", "c"), ("tandem.cli.main", None)]


@pytest.mark.parametrize("name", BUILD_FILES)
def test_every_tandem_module_a_build_file_names_exists(name: str) -> None:
    path = ROOT / name
    if not path.exists():
        pytest.fail(f"{name} is listed here but is gone; update BUILD_FILES")
    missing = []
    for module, attr in named_modules(path.read_text()):
        if importlib.util.find_spec(module) is None:
            missing.append(module)
        elif attr is not None and not hasattr(importlib.import_module(module), attr):
            missing.append(f"{module}.{attr}")
    assert missing == [], f"{name} names tandem modules that do not exist: {missing}"
