"""The package table of docs/ARCHITECTURE.md is what the code does.

Every module of the four packages is parsed with ``ast`` (nothing is imported, so
lazy and ``TYPE_CHECKING`` imports count too); the packages of this project each one
imports must be among those its row's "may import" column names in backticks.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGES = ("patcher", "bulletin_kernels", "schemas", "bulletin")
GROUND_FLOOR = ("patcher", "bulletin_kernels", "schemas")
#: Where each package's source lies: the kernels' import name is not their folder's
#: (docs/ARCHITECTURE.md, below the table).
SOURCES = {package: ROOT / package for package in PACKAGES} | {
    "bulletin_kernels": ROOT / "kernels" / "bulletin_kernels"
}


def may_import() -> dict[str, set[str]]:
    """The table's "may import" column: project packages each package may import."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    header = "| package | what it holds | may import |"
    assert header in text, "docs/ARCHITECTURE.md lost its package table"
    table: dict[str, set[str]] = {}
    for line in text[text.index(header) :].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        package = re.fullmatch(r"`(?:\w+/)*(\w+)/`", cells[0])
        assert package, f"a package cell is `path/name/`: {cells[0]!r}"
        assert ROOT / cells[0].strip("`") == SOURCES.get(package.group(1)), cells[0]
        named = {ticked.split(".")[0].rstrip("/") for ticked in re.findall(r"`([^`]+)`", cells[-1])}
        table[package.group(1)] = named & set(PACKAGES)
    return table


def imported_packages(path: Path) -> Iterator[tuple[str, int]]:
    """(top-level package, line) of every absolute import in the module at ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.split(".")[0], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0], node.lineno


def imports_of(package: str) -> dict[str, list[str]]:
    """Project packages other than itself that ``package`` imports, with where."""
    found: dict[str, list[str]] = {}
    modules = sorted(SOURCES[package].rglob("*.py"))
    assert modules, package
    for path in modules:
        for imported, line in imported_packages(path):
            if imported in PACKAGES and imported != package:
                found.setdefault(imported, []).append(f"{path.relative_to(ROOT)}:{line}")
    return found


TABLE = may_import()


def test_the_table_lists_every_package() -> None:
    assert set(TABLE) == set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_are_within_the_table(package: str) -> None:
    extra = {name: where for name, where in imports_of(package).items() if name not in TABLE[package]}
    assert not extra, f"{package}/ imports what docs/ARCHITECTURE.md does not allow: {extra}"


@pytest.mark.parametrize("package", GROUND_FLOOR)
def test_the_ground_floor_never_imports_bulletin(package: str) -> None:
    assert "bulletin" not in TABLE[package]
    assert "bulletin" not in imports_of(package), imports_of(package)["bulletin"]


def test_imports_only_go_up_the_table() -> None:
    order = list(TABLE)  # the table's own order, lowest first
    for package, allowed in TABLE.items():
        assert all(order.index(name) < order.index(package) for name in allowed), package
