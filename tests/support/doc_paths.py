"""Source paths named in the docs that the tree no longer has.

A doc names code in backticks: a file (`frontend/app.py`, `src/tandem/router/kv.py`,
`chain_hash.c`, `http/`), or a dotted module (`tandem.router.kv`, `tandem.cli.main:main`,
`tandem.runtime.metrics.render`: a module and one name in it). `missing_paths` returns the
ones that point nowhere, so a doc cannot go on naming a file that moved or is gone.

Where a name is looked for: relative to the doc's folder, the repository root, `src/` and
`src/tandem/`, or as the tail of a path inside the doc's package (a package README's
folder; `src/tandem` and `tests` for a doc outside the source tree): `frame.py`,
`kernels/ops.c`. Endpoint addresses (`tandem.backend.generate`) are not modules and are
not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

_BACKTICKED = re.compile(r"`([^`\n]+)`")
_SOURCE_FILE = re.compile(r"^[\w./-]+\.(?:py|c|h|md)$")
_FOLDER = re.compile(r"^[\w.-]+(?:/[\w.-]+)*/$")
_DOTTED = re.compile(r"^tandem(?:\.\w+)+(?::\w+)?$")
_ROOTED = ("src/", "docs/", "tests/", "deploy/")
EXTERNAL = frozenset({"Python.h"})
"""Files a doc names that live outside the tree."""


def named_paths(text: str) -> list[str]:
    """Backticked names in `text` that look like source files, folders or dotted modules."""
    names = []
    for token in _BACKTICKED.findall(text):
        token = token.strip()
        if (
            _DOTTED.match(token)
            or _FOLDER.match(token)
            or (
                _SOURCE_FILE.match(token)
                or (token.startswith(_ROOTED) and re.match(r"^[\w./-]+$", token))
            )
        ):
            names.append(token)
    return names


def _module_exists(dotted: str, src: Path) -> bool:
    parts = dotted.split(":", 1)[0].split(".")
    top = src / parts[0]
    if len(parts) > 1 and not (top / parts[1]).is_dir() and not (top / f"{parts[1]}.py").is_file():
        # `tandem.backend.generate` (namespace.component.endpoint) is an address, not a module
        return len(parts) == 3
    for cut in range(len(parts), 0, -1):
        base = src.joinpath(*parts[:cut])
        source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if not source.is_file():
            continue
        rest = parts[cut:]
        if not rest:
            return True
        # a module and one name in it (`tandem.runtime.metrics.render`), or in its package
        # (`tandem.router.route`: the router service's endpoint)
        texts = (
            path.read_text(encoding="utf-8")
            for path in (base.rglob("*.py") if base.is_dir() else [source])
        )
        return len(rest) == 1 and any(
            re.search(rf"\b{re.escape(rest[0])}\b", text) for text in texts
        )
    return False


def _file_exists(name: str, doc: Path, repo: Path) -> bool:
    if name in EXTERNAL:
        return True
    src = repo / "src"
    homes = [doc.parent] if src in doc.parents else [src / "tandem", repo / "tests"]
    if "/" not in name.rstrip("/") and any(next(home.rglob(name), None) for home in homes):
        return True
    if any((base / name).exists() for base in (doc.parent, repo, src, src / "tandem")):
        return True
    # `kernels/ops.c` in the engines' README: a path inside one of the package's folders
    return any(
        path.as_posix().endswith("/" + name.rstrip("/"))
        for home in homes
        for path in home.rglob("*")
    )


def missing_paths(doc: Path, repo: Path) -> list[str]:
    """Names in `doc` that look like source paths and do not exist under `repo`."""
    missing = []
    for name in named_paths(doc.read_text(encoding="utf-8")):
        exists = (
            _module_exists(name, repo / "src")
            if _DOTTED.match(name)
            else _file_exists(name, doc, repo)
        )
        if not exists:
            missing.append(name)
    return missing


def package_entries(package: Path) -> list[str]:
    """A package's own modules (`name.py`, not `__init__.py`) and subpackages (`name/`)."""
    entries = []
    for path in sorted(package.iterdir()):
        if path.is_dir() and (path / "__init__.py").is_file():
            entries.append(f"{path.name}/")
        elif path.suffix == ".py" and path.name != "__init__.py":
            entries.append(path.name)
    return entries


def unlisted_entries(readme: Path) -> list[str]:
    """Modules and subpackages of the README's package that its text does not name in backticks."""
    named = set(_BACKTICKED.findall(readme.read_text(encoding="utf-8")))
    return [entry for entry in package_entries(readme.parent) if entry not in named]
