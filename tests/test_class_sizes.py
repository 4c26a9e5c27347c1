"""Class sizes in pdserve/ (issue 52): no class over 400 lines, `Cluster` under 300.

A class's size is the span of its `class` statement, `end_lineno - lineno + 1` (decorators
left out; docstring, comments and blank lines counted), read from the source with `ast`.
Nested classes count on their own too. A class that grows past its limit is a class doing
more than one job: split a piece with one job out of it instead of raising the limit.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PDSERVE = Path(__file__).resolve().parents[1] / "pdserve"
MAX_CLASS_LINES = 400
# Stricter limits, (path under pdserve/, class name) -> the size the class stays under.
UNDER: dict[tuple[str, str], int] = {("cluster/controller.py", "Cluster"): 300}


@dataclass(frozen=True)
class ClassSize:
    path: str  # under pdserve/
    line: int
    name: str
    lines: int

    def __str__(self) -> str:
        return f"pdserve/{self.path}:{self.line} {self.name}: {self.lines} lines"


def class_sizes(root: Path = PDSERVE) -> list[ClassSize]:
    """Every class defined in root/**/*.py, in file and line order."""
    sizes = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                rel = path.relative_to(root).as_posix()
                sizes.append(
                    ClassSize(rel, node.lineno, node.name, node.end_lineno - node.lineno + 1)
                )
    return sorted(sizes, key=lambda s: (s.path, s.line))


def test_the_walk_finds_classes_and_measures_them() -> None:
    sizes = {(s.path, s.name): s for s in class_sizes()}
    assert len(sizes) > 100
    pool = sizes[("kv/block_pool.py", "BlockPool")]
    source = (PDSERVE / "kv/block_pool.py").read_text().splitlines()
    assert source[pool.line - 1].startswith("class BlockPool")
    assert source[pool.line + pool.lines - 2].strip()  # the last line is the class's own
    assert not source[pool.line + pool.lines - 1].startswith(" ")  # the next one is not


def test_no_class_is_over_400_lines() -> None:
    offenders = [s for s in class_sizes() if s.lines > MAX_CLASS_LINES]
    for size in offenders:
        print(size)
    assert not offenders, f"classes over {MAX_CLASS_LINES} lines:\n" + "\n".join(
        f"  {s}" for s in offenders
    )


def test_classes_with_a_stricter_limit_stay_under_it() -> None:
    sizes = {(s.path, s.name): s for s in class_sizes()}
    missing = [key for key in UNDER if key not in sizes]
    assert not missing, f"classes with a limit not found (moved or renamed?): {missing}"
    offenders = [sizes[key] for key, limit in UNDER.items() if sizes[key].lines >= limit]
    for size in offenders:
        print(size)
    assert not offenders, "classes at or over their limit:\n" + "\n".join(
        f"  {s} (limit: under {UNDER[(s.path, s.name)]})" for s in offenders
    )
