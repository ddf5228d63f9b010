"""Imports flow down the package table of docs/architecture.md, with no circles (issue 29 §6)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.support.layers import check_layers, import_circles, read_package_order

REPO = Path(__file__).resolve().parents[2]
ARCHITECTURE = REPO / "docs" / "architecture.md"

TABLE = """# map

## Packages (imports flow down this table)

| package | role |
|---|---|
| `tandem` (top-level modules: `errors.py`) | base |
| `tandem.low` | below |
| `tandem.high` | above |
| `tandem.cli` | the command |

## Next section
| `tandem.not_a_row` | ignored |
"""


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    src = tmp_path / "src"
    for name, body in {"tandem/__init__.py": "", "tandem/errors.py": "", **files}.items():
        path = src / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
    return src


def _order(tmp_path: Path) -> list[str]:
    doc = tmp_path / "architecture.md"
    doc.write_text(TABLE)
    return read_package_order(doc)


CLEAN = {
    "tandem/low/__init__.py": "",
    "tandem/low/wire.py": "from tandem.errors import ServingError\n",
    "tandem/high/__init__.py": "from .engine import Engine\n",
    "tandem/high/engine.py": "from tandem.low import wire\nfrom ..low.wire import X\n",
    "tandem/cli/__init__.py": "",
    "tandem/cli/serve.py": "import tandem.high.main\n",
    "tandem/high/main.py": "from tandem.high.engine import Engine\n",
}


def test_the_order_is_the_tables_rows(tmp_path: Path) -> None:
    assert _order(tmp_path) == ["tandem", "low", "high", "cli"]


def test_a_doc_without_the_table_is_refused(tmp_path: Path) -> None:
    doc = tmp_path / "architecture.md"
    doc.write_text("# map\n\nno table here\n")
    with pytest.raises(ValueError, match="no package table"):
        read_package_order(doc)


def test_a_tree_that_follows_the_table_passes(tmp_path: Path) -> None:
    assert check_layers(_tree(tmp_path, CLEAN), _order(tmp_path)) == []


@pytest.mark.parametrize(
    "importer",
    [
        "from tandem.high.engine import Engine\n",
        "from tandem.high import engine\n",
        "import tandem.high.engine\n",
        "def late():\n    from ..high.engine import Engine\n",
        "if TYPE_CHECKING:\n    from tandem.high.engine import Engine\n",
    ],
)
def test_an_upward_import_is_named_in_every_form(tmp_path: Path, importer: str) -> None:
    src = _tree(tmp_path, {**CLEAN, "tandem/low/wire.py": importer})
    assert check_layers(src, _order(tmp_path)) == [
        "upward import: tandem.low.wire (low) imports tandem.high.engine (high)",
        "import circle: tandem.high.engine ↔ tandem.low.wire",
    ]


def test_a_base_module_importing_a_package_is_upward(tmp_path: Path) -> None:
    src = _tree(tmp_path, {**CLEAN, "tandem/errors.py": "from tandem.low.wire import X\n"})
    assert check_layers(src, _order(tmp_path)) == [
        "upward import: tandem.errors (tandem) imports tandem.low.wire (low)",
        "import circle: tandem.errors ↔ tandem.low.wire",
    ]


def test_a_circle_inside_a_package_names_its_modules(tmp_path: Path) -> None:
    src = _tree(
        tmp_path,
        {
            **CLEAN,
            "tandem/high/a.py": "from tandem.high import b\n",
            "tandem/high/b.py": "def f():\n    from .c import C\n",
            "tandem/high/c.py": "if TYPE_CHECKING:\n    from tandem.high.a import A\n",
        },
    )
    assert check_layers(src, _order(tmp_path)) == [
        "import circle: tandem.high.a ↔ tandem.high.b ↔ tandem.high.c"
    ]


def test_a_package_init_reexporting_its_importer_is_a_circle(tmp_path: Path) -> None:
    src = _tree(tmp_path, {**CLEAN, "tandem/high/engine.py": "from tandem.high import Engine\n"})
    assert check_layers(src, _order(tmp_path)) == [
        "import circle: tandem.high ↔ tandem.high.engine"
    ]


def test_a_package_missing_from_the_table_is_named(tmp_path: Path) -> None:
    src = _tree(tmp_path, {**CLEAN, "tandem/extra/__init__.py": "", "tandem/extra/thing.py": ""})
    assert check_layers(src, _order(tmp_path)) == [
        "package tandem.extra is missing from the package table"
    ]


def test_a_table_row_without_a_package_is_named(tmp_path: Path) -> None:
    files = {name: body for name, body in CLEAN.items() if not name.startswith("tandem/cli/")}
    assert check_layers(_tree(tmp_path, files), _order(tmp_path)) == [
        "the package table names tandem.cli, which src/tandem does not have"
    ]


@pytest.mark.parametrize(
    ("target", "body"),
    [
        ("tandem.high.main", "from tandem.high.main import run\n"),
        ("tandem.high.service", "from tandem.high import service\n"),
        ("tandem.high.__main__", "import tandem.high.__main__\n"),
    ],
)
def test_importing_another_packages_entry_point_is_named(
    tmp_path: Path, target: str, body: str
) -> None:
    src = _tree(
        tmp_path,
        {
            **CLEAN,
            "tandem/high/service.py": "",
            "tandem/high/__main__.py": "",
            "tandem/top/__init__.py": "",
            "tandem/top/bench.py": body,
        },
    )
    order = [*_order(tmp_path)[:-1], "top", "cli"]
    assert check_layers(src, order) == [
        f"entry-point import: tandem.top.bench imports {target} (a process entry point)"
    ]


def test_importing_the_cli_from_below_is_upward_and_an_entry_point(tmp_path: Path) -> None:
    src = _tree(
        tmp_path, {**CLEAN, "tandem/high/__main__.py": "from tandem.cli.serve import main\n"}
    )
    assert check_layers(src, _order(tmp_path)) == [
        "upward import: tandem.high.__main__ (high) imports tandem.cli.serve (cli)",
        "entry-point import: tandem.high.__main__ imports tandem.cli.serve (a process entry point)",
    ]


def test_circles_are_strongly_connected_components() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert import_circles(graph) == [["a", "b", "c"], ["d", "e"]]


def test_tandem_imports_flow_down_the_architecture_table() -> None:
    problems = check_layers(REPO / "src", read_package_order(ARCHITECTURE))
    assert problems == [], "\n".join(problems)
