"""Every file, folder and module the documentation names exists: a stale reference is a bug.

Scanned: ``README.md``, ``docs/*.md``, ``tests/golden/README.md``, the scripts (``scripts/*.sh``,
``scripts/*.py``, their docstrings and comments), ``pyproject.toml`` and ``setup.py``.
Checked there:

- relative Markdown links, ``[text](path#anchor)``, resolved from the linking file (in
  Markdown files only);
- repository paths, backticked or not (``scripts/bench_sync.py``, ``tests/run``), that
  start with a top-level folder of the repository;
- backticked file names alone (``keyspace.py``): some file of that name exists;
- backticked dotted names rooted in a package (``bulletin.run``, ``patcher.native.disabled()``):
  the module exists, and so does each attribute named after it.

URLs, globs (``kernels/bulletin_kernels/*.cu``) and placeholders (``v<major>/``, ``<dir>``) are skipped.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = sorted(
    [
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        ROOT / "tests" / "golden" / "README.md",
        *(ROOT / "scripts").glob("*.sh"),
        *(ROOT / "scripts").glob("*.py"),
        ROOT / "pyproject.toml",
        ROOT / "setup.py",
    ]
)
PACKAGES = ("bulletin", "patcher", "bulletin_kernels", "schemas")
#: Where a package's source lies when that is not ``ROOT / name`` (docs/ARCHITECTURE.md).
SOURCES = {"bulletin_kernels": ROOT / "kernels" / "bulletin_kernels"}
TOP_LEVEL = ("bulletin", "patcher", "kernels", "schemas", "docs", "scripts", "tests", "localstack", ".ci")
#: Endings of the file names worth checking when named alone (a ``.json`` named alone is
#: mostly a file the code writes at run time, such as a journal).
FILE_ENDINGS = (".py", ".pyi", ".c", ".h", ".cu", ".hpp", ".sh", ".md", ".toml")
#: Names that look like references and are not.
NOT_REFERENCES = {
    "bulletin.last_error": "a field of the sidecar's status document",
    "tests/golden/v2": "the folder a future format major version will write",
}
SKIPPED_DIRS = {".git", ".venv", ".localstack", ".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis"}
#: Globs and placeholders: a pattern or a template, not a path.
NOT_A_PATH = re.compile(r"[<>*?{}$]|\.\.\.")

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
BACKTICKED = re.compile(r"`([^`\n]+)`")
REPO_PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(re.escape(t) for t in TOP_LEVEL)})/[\w./<>*?{{}}$-]*)")
DOTTED = re.compile(rf"^(?:{'|'.join(PACKAGES)})(?:\.\w+)+(?:\(\))?$")
FILE_NAME = re.compile(r"^\w[\w.-]*$")


@cache
def file_names() -> frozenset[str]:
    """The names of every file in the repository (virtual environments and caches aside)."""
    names: set[str] = set()
    stack = [ROOT]
    while stack:
        for entry in stack.pop().iterdir():
            if entry.is_dir():
                if entry.name not in SKIPPED_DIRS and not entry.name.endswith(".egg-info"):
                    stack.append(entry)
            else:
                names.add(entry.name)
    return frozenset(names)


def references(doc: Path) -> Iterator[tuple[str, str]]:
    """(what the document names, why it is wrong) for each reference that is broken."""
    for name, why in _references(doc):
        if name not in NOT_REFERENCES:
            yield name, why


def _references(doc: Path) -> Iterator[tuple[str, str]]:
    text = doc.read_text(encoding="utf-8")
    if doc.suffix == ".sh":
        text = re.sub(r'"?\$\{?repo\}?"?/', "", text)  # "$repo/scripts/x.py" names scripts/x.py
    for target in LINK.findall(text) if doc.suffix == ".md" else ():
        path = target.split("#", 1)[0]
        if not path or "://" in path or path.startswith("mailto:"):
            continue
        if not (doc.parent / path).exists():
            yield target, "link to a missing file"
    for found in REPO_PATH.findall(text):
        path = found.rstrip(".,:;")
        if NOT_A_PATH.search(path):
            continue
        if not (ROOT / path).exists():
            yield path, "no such path"
    for token in (t.strip() for t in BACKTICKED.findall(text)):
        if DOTTED.match(token):
            problem = _dotted(token.removesuffix("()"))
            if problem:
                yield token, problem
        elif FILE_NAME.match(token) and token.endswith(FILE_ENDINGS) and token not in file_names():
            yield token, "no file of that name"


def _dotted(name: str) -> str | None:
    """Why ``name`` (a module, then attributes) does not resolve; ``None`` when it does."""
    parts = name.split(".")
    path = SOURCES.get(parts[0], ROOT / parts[0])
    module = parts[0]
    rest = parts[1:]
    while rest:
        here = path / rest[0]
        if not (here.is_dir() or here.with_suffix(".py").exists() or here.with_suffix(".c").exists()):
            break
        path, module, rest = here, f"{module}.{rest[0]}", rest[1:]
    if not rest:
        return None
    try:
        obj: object = importlib.import_module(module)
    except ImportError as exc:
        return f"module {module} does not import: {exc}"
    for attribute in rest:
        if not hasattr(obj, attribute):
            return f"{module} has no {attribute!r}"
        obj = getattr(obj, attribute)
    return None


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_reference_exists(doc: Path) -> None:
    broken = sorted(set(references(doc)))
    assert not broken, f"{doc.relative_to(ROOT)} names what does not exist: " + "; ".join(
        f"{name} ({why})" for name, why in broken
    )


def test_the_scanner_finds_what_it_should(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "[a](missing.md) [b](https://example.com/x) [c](#anchor) see scripts/nothing.py and "
        "`tests/golden/v<major>/`, `kernels/bulletin_kernels/*.cu`, `bulletin/chain.py`, `layout.py`, `README.md`, "
        "`bulletin.chain`, `bulletin.run`, `patcher.native.disabled()`, `patcher.native.nothing`.\n",
        encoding="utf-8",
    )
    assert sorted(name for name, _ in references(doc)) == [
        "bulletin.chain",
        "bulletin/chain.py",
        "layout.py",
        "missing.md",
        "patcher.native.nothing",
        "scripts/nothing.py",
    ]


def test_shell_paths_are_read_from_the_repository_root(tmp_path: Path) -> None:
    script = tmp_path / "x.sh"
    script.write_text('"$repo/localstack/start.sh"\n"$repo/scripts/nothing.sh" --flag\n', encoding="utf-8")
    assert [name for name, _ in references(script)] == ["scripts/nothing.sh"]
