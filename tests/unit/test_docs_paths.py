"""The docs and the package READMEs name only files and modules that exist (issue 29 §6)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.support.doc_paths import missing_paths, named_paths

REPO = Path(__file__).resolve().parents[2]
DOCS = [
    *sorted((REPO / "docs").glob("*.md")),
    *sorted((REPO / "src" / "tandem").glob("*/README.md")),
]


def test_source_like_names_are_picked_out() -> None:
    text = (
        "`frontend/app.py` and `tandem.router.kv`, `tandem.cli.main:main`, `src/tandem/errors.py`, "
        "`http/`, `chain_hash.c`, not `--migration-limit`, `make venv`, `x-worker-id` or `ok`"
    )
    assert named_paths(text) == [
        "frontend/app.py",
        "tandem.router.kv",
        "tandem.cli.main:main",
        "src/tandem/errors.py",
        "http/",
        "chain_hash.c",
    ]


def test_a_name_that_is_gone_is_reported(tmp_path: Path) -> None:
    package = tmp_path / "src" / "tandem" / "router"
    (package / "policy").mkdir(parents=True)
    (tmp_path / "src" / "tandem" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "kv.py").write_text("def route(): ...\n")
    (package / "policy" / "random.py").write_text("")
    readme = package / "README.md"
    readme.write_text(
        "`kv.py`, `policy/random.py`, `random.py`, `router/kv.py`, `tandem.router.kv`,"
        " `tandem.router.kv.route`, `tandem.backend.generate`, `policy/`\n"
        "gone: `old.py`, `policy/kv.py`, `tandem.router.old`, `tandem.router.kv.nothing`,"
        " `frontend/app.py`, `tandem.frontnd`\n"
    )
    assert missing_paths(readme, tmp_path) == [
        "old.py",
        "policy/kv.py",
        "tandem.router.old",
        "tandem.router.kv.nothing",
        "frontend/app.py",
        "tandem.frontnd",
    ]


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: str(doc.relative_to(REPO)))
def test_docs_name_only_paths_that_exist(doc: Path) -> None:
    assert missing_paths(doc, REPO) == []
