"""The `pdserve` import graph, read from the source with `ast`: what tests/test_imports.py
(no cycles) and tests/test_layers.py (every import points down) check.

One node per module under `pdserve/` (a package's `__init__.py` is the package itself),
one arrow per import of a `pdserve` module, with the file and line it is written on.

- `import a.b.c` is an arrow to `a.b.c`; `from pkg import name` is an arrow to `pkg.name`
  when that is a module, else to `pkg` (then `name` is an attribute of the package's
  `__init__`). Relative imports are resolved against the importing module.
- Imports anywhere count, inside functions too: a lazy import is a run-time dependency
  that only runs later.
- Imports under `if TYPE_CHECKING:` count only when asked for (`type_checking=True`):
  they never run, but they still name what the module's annotations depend on. Their
  `else:` branches do run, so those always count.
- Importing `pkg.mod` also runs `pkg/__init__.py` first, but that implicit arrow is not
  drawn: a package whose `__init__` re-exports its submodules would otherwise be a "cycle"
  with each of them, and Python handles that order by design.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pdserve

ROOT = Path(pdserve.__file__).parent


@dataclass(frozen=True)
class Arrow:
    """`source` imports `target`, at `path`:`line`."""

    source: str
    target: str
    path: Path
    line: int

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT.parent)}:{self.line}"


def module_names() -> dict[str, Path]:
    """Every module under pdserve/ by dotted name (a package's __init__ as the package)."""
    names: dict[str, Path] = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(node: ast.AST, type_checking: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements anywhere below `node`; those in `if TYPE_CHECKING:` bodies only
    with `type_checking` (their `else:` branches always)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test) and not type_checking:
            for stmt in child.orelse:
                yield from _imports_of_stmt(stmt, type_checking)
            continue
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        yield from imports(child, type_checking)


def _imports_of_stmt(stmt: ast.stmt, type_checking: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(stmt, ast.Import | ast.ImportFrom):
        yield stmt
    yield from imports(stmt, type_checking)


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """`name`, or its closest enclosing module, if it is a pdserve module."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def arrows(type_checking: bool = False) -> list[Arrow]:
    """Every import of one pdserve module by another, in file and line order (one arrow
    per statement and module imported)."""
    modules = module_names()
    found: set[Arrow] = set()
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in imports(tree, type_checking):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    package = name if is_package else name.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        package = package.rpartition(".")[0]
                    base = f"{package}.{base}" if base else package
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for target in targets:
                known = _known(target, modules)
                if known is not None and known != name:
                    found.add(Arrow(name, known, path, node.lineno))
    return sorted(found, key=lambda a: (str(a.path), a.line, a.target))


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the modules it imports."""
    graph: dict[str, set[str]] = {name: set() for name in module_names()}
    for arrow in arrows(type_checking):
        graph[arrow.source].add(arrow.target)
    return graph
