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


# What the engine core must not name (issue 52): its features are participants it calls
# through one interface (engine/participant.py), never by name. Matched case-insensitively
# against the source of the EngineCore class, docstrings and comments included.
CORE_MUST_NOT_NAME = ("replica", "replicat", "exchange", "offer", "predict", "length_head")


def named_features(source: str, class_name: str, words: tuple[str, ...]) -> list[str]:
    """`words` found in the source of class `class_name` (first match each), as
    'line N: word'."""
    tree = ast.parse(source)
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name]
    assert node.end_lineno is not None
    lines = source.splitlines()[node.lineno - 1 : node.end_lineno]
    found = []
    for word in words:
        for i, line in enumerate(lines, node.lineno):
            if word in line.lower():
                found.append(f"line {i}: {word!r} in {line.strip()!r}")
                break
    return found


def test_the_engine_core_names_none_of_its_features() -> None:
    source = (PDSERVE / "engine/core.py").read_text()
    found = named_features(source, "EngineCore", CORE_MUST_NOT_NAME)
    assert not found, "EngineCore names features it should reach as participants:\n" + "\n".join(
        f"  pdserve/engine/core.py {f}" for f in found
    )


def test_the_name_check_sees_a_feature_named_in_a_class() -> None:
    source = "class EngineCore:\n    def step(self):\n        self.replicator.step_ended()\n"
    assert named_features(source, "EngineCore", CORE_MUST_NOT_NAME) == [
        "line 3: 'replica' in 'self.replicator.step_ended()'",
        "line 3: 'replicat' in 'self.replicator.step_ended()'",
    ]
