"""The import-direction check: tandem's packages import only downwards, without circles.

The package order is read from one place, the package table in `docs/architecture.md`
(rows in order, bottom of the stack first; the row for the top-level modules of
`tandem` itself names `tandem`). Every module under `src/tandem` is parsed with `ast`
and every import counts: module level, inside functions, under `TYPE_CHECKING`,
absolute and relative. `from package import name` where `name` is a submodule
counts as importing that submodule.

`check_layers` returns one line per violation; an empty list means the tree holds:
- a package (a folder or a top-level module's package) missing from the table,
  or a table row naming a package the tree does not have;
- an upward import: a module of package A imports package B listed after A;
- an import circle between modules (a strongly connected component of the module
  graph), inside a package too;
- a package importing another package's process entry point (`__main__`, `main`,
  `service`, or anything in `cli`): processes meet over the runtime, not by import.
  `cli` itself is the one package that starts processes, so it may import them.

Imports by string (`importlib.import_module` in the engine and transfer registries)
are not seen.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

BASE = "tandem"
"""The table's name for the top-level modules (`tandem/__init__.py`, `errors.py`, ...)."""

ENTRY_POINT_MODULES = frozenset({"__main__", "main", "service"})
ENTRY_POINT_PACKAGES = frozenset({"cli"})

_TABLE_HEADING = re.compile(r"^##+ .*\bpackages?\b", re.IGNORECASE)
_TABLE_NAME = re.compile(r"`(tandem(?:\.\w+)?)`")


@dataclass(frozen=True, slots=True)
class Module:
    name: str  # dotted, e.g. "tandem.router.kv" (a package's __init__ is the package name)
    path: Path
    is_package: bool

    @property
    def package(self) -> str:
        """The top-level package this module belongs to; `tandem` for the base modules."""
        parts = self.name.split(".")
        if len(parts) == 1 or (len(parts) == 2 and not self.is_package):
            return BASE
        return parts[1]


def read_package_order(doc: Path) -> list[str]:
    """Package names in the order of the first table under a "Packages" heading of `doc`.

    A row's package is the first backticked `tandem` or `tandem.<name>` in it; the result
    holds `tandem` for the base modules and the bare `<name>` for each package.
    """
    order: list[str] = []
    in_section = False
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            if order:
                break
            in_section = bool(_TABLE_HEADING.match(line))
            continue
        if not in_section or not line.startswith("|"):
            if order and not line.startswith("|"):
                break
            continue
        match = _TABLE_NAME.search(line)
        if match is None:
            continue
        dotted = match.group(1)
        order.append(BASE if dotted == BASE else dotted.split(".", 1)[1])
    if not order:
        raise ValueError(
            f"{doc}: no package table (a '## ... Packages' heading, rows naming `tandem.<name>`)"
        )
    return order


def find_modules(src: Path) -> dict[str, Module]:
    """Every module of the `tandem` package under `src` (the folder holding `tandem/`)."""
    modules: dict[str, Module] = {}
    for path in sorted((src / BASE).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        name = ".".join(parts)
        modules[name] = Module(name=name, path=path, is_package=is_package)
    return modules


def _resolve(name: str, modules: dict[str, Module]) -> str | None:
    """The module an imported dotted name runs: the name itself, or its nearest parent."""
    while name not in modules:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name


def imports_of(module: Module, modules: dict[str, Module]) -> set[str]:
    """The tandem modules `module` imports, anywhere in its body."""
    tree = ast.parse(module.path.read_text(encoding="utf-8"), filename=str(module.path))
    own_package = module.name if module.is_package else module.name.rsplit(".", 1)[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = own_package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            names = [
                f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules else origin
                for alias in node.names
            ]
        else:
            continue
        for name in names:
            if name == BASE or name.startswith(BASE + "."):
                target = _resolve(name, modules)
                if target is not None and target != module.name:
                    targets.add(target)
    return targets


def module_graph(src: Path) -> tuple[dict[str, Module], dict[str, set[str]]]:
    modules = find_modules(src)
    return modules, {name: imports_of(module, modules) for name, module in modules.items()}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, list[str]]] = [(root, sorted(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, pending = work[-1]
            if pending:
                nxt = pending.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph.get(nxt, ()))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return sorted(circles)


def _dotted(package: str) -> str:
    return BASE if package == BASE else f"{BASE}.{package}"


def _is_entry_point(module: Module) -> bool:
    return (
        module.package in ENTRY_POINT_PACKAGES
        or module.name.rsplit(".", 1)[-1] in ENTRY_POINT_MODULES
    )


def check_layers(src: Path, order: list[str]) -> list[str]:
    """Every violation of the package order and the no-circle rule, one line each."""
    modules, graph = module_graph(src)
    rank = {package: position for position, package in enumerate(order)}
    problems: list[str] = []
    present = {module.package for module in modules.values()}
    for package in sorted(present - rank.keys()):
        problems.append(f"package {_dotted(package)} is missing from the package table")
    for package in sorted(rank.keys() - present):
        problems.append(
            f"the package table names {_dotted(package)}, which src/tandem does not have"
        )
    for name in sorted(graph):
        source = modules[name]
        for target_name in sorted(graph[name]):
            target = modules[target_name]
            if source.package == target.package:
                continue
            if (
                source.package in rank
                and target.package in rank
                and rank[target.package] > rank[source.package]
            ):
                problems.append(
                    f"upward import: {name} ({source.package})"
                    f" imports {target_name} ({target.package})"
                )
            if _is_entry_point(target) and source.package not in ENTRY_POINT_PACKAGES:
                problems.append(
                    f"entry-point import: {name} imports {target_name} (a process entry point)"
                )
    for circle in import_circles(graph):
        problems.append(f"import circle: {' ↔ '.join(circle)}")
    return problems
