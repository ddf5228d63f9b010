"""The docs and the package READMEs name only files and modules that exist (issue 29 §6)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.support.doc_paths import missing_paths, named_paths, unlisted_entries

REPO = Path(__file__).resolve().parents[2]
READMES = sorted((REPO / "src" / "tandem").glob("*/README.md"))
DOCS = [
    *sorted((REPO / "docs").glob("*.md")),
    *READMES,
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


def test_a_module_the_readme_does_not_list_is_reported(tmp_path: Path) -> None:
    package = tmp_path / "router"
    (package / "policy").mkdir(parents=True)
    (package / "static").mkdir()
    for name in ("__init__.py", "kv.py", "simple.py", "policy/__init__.py"):
        (package / name).write_text("")
    readme = package / "README.md"
    readme.write_text("## Layout\n\n- `kv.py`: the KV router\n")
    assert unlisted_entries(readme) == ["policy/", "simple.py"]
    readme.write_text("## Layout\n\n- `kv.py`, `policy/`, `simple.py`\n")
    assert unlisted_entries(readme) == []


def test_every_package_has_a_readme() -> None:
    packages = [path.parent for path in (REPO / "src" / "tandem").glob("*/__init__.py")]
    assert sorted(path.name for path in packages if not (path / "README.md").is_file()) == []


@pytest.mark.parametrize("readme", READMES, ids=lambda doc: str(doc.relative_to(REPO)))
def test_readmes_list_every_module_of_their_package(readme: Path) -> None:
    assert unlisted_entries(readme) == []
