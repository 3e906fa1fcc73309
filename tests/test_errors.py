"""The exception tree: one root, stable codes, builtin mixins and exit statuses as documented.

The documented table is the one in ``docs/ARCHITECTURE.md`` (section "Errors"); the
README's one-line summary of exit statuses is checked against it too, so docs and
code cannot drift apart.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import re
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import pytest
from pydantic import ValidationError

import bulletin.errors
import patcher.errors
from bulletin import Publisher, Subscriber
from bulletin.checkpoint import parse_safetensors_header
from bulletin.cli.output import exit_status
from bulletin.errors import (
    BulletinError,
    ConfigError,
    FingerprintMismatch,
    FormatError,
    InternalError,
    InvalidInput,
    WrongBase,
)
from bulletin.run import Run
from bulletin.storage import open_store
from bulletin.sync import SyncPlan, execute
from bulletin.target import ArrayTarget, LocalDirTarget
from tests.run.helpers import ToyTrainer

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
README = ROOT / "README.md"
MODULES: dict[str, ModuleType] = {"patcher": patcher.errors, "bulletin": bulletin.errors}


class Row(NamedTuple):
    kind: str
    bases: tuple[str, ...]
    defined_in: str
    code: str
    exit_status: int


def _ticked(cell: str) -> tuple[str, ...]:
    return tuple(re.findall(r"`([^`]+)`", cell))


def documented() -> dict[str, Row]:
    """The rows of ARCHITECTURE.md's error table, by kind."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    header = "| kind | subclass of | defined in | code | exit status | what a caller does |"
    assert header in text, "docs/ARCHITECTURE.md lost its table of errors"
    rows: dict[str, Row] = {}
    for line in text[text.index(header) :].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        (kind,), bases, (defined_in,), (code,) = (_ticked(c) for c in cells[:4])
        assert kind not in rows, f"{kind} is listed twice"
        rows[kind] = Row(kind, bases, defined_in, code, int(cells[4]))
    return rows


def public_classes(module: ModuleType) -> dict[str, type]:
    names: list[str] = module.__all__
    return {name: getattr(module, name) for name in names if inspect.isclass(getattr(module, name))}


#: Every public class of the tree (bulletin.errors holds them all), as the type it must be.
ALL: dict[str, type[BulletinError]] = {
    name: cls for name, cls in public_classes(bulletin.errors).items() if issubclass(cls, BulletinError)
}
DOCUMENTED = documented()


def test_every_public_class_is_a_bulletin_error() -> None:
    for module in MODULES.values():
        for name, cls in public_classes(module).items():
            assert issubclass(cls, BulletinError), f"{module.__name__}.{name}"


def test_every_class_defined_in_the_modules_is_public() -> None:
    for module in MODULES.values():
        defined = {
            name
            for name, obj in vars(module).items()
            if inspect.isclass(obj) and obj.__module__ == module.__name__ and not name.startswith("_")
        }
        assert defined <= set(module.__all__), f"{module.__name__}: not in __all__: {defined - set(module.__all__)}"


def test_bulletin_errors_reexports_the_ground_floor_as_the_same_objects() -> None:
    for name, cls in public_classes(patcher.errors).items():
        assert getattr(bulletin.errors, name) is cls, name
        assert name in bulletin.errors.__all__, name
        assert cls.__module__ == "patcher.errors", name
    for name, cls in ALL.items():
        if name not in patcher.errors.__all__:
            assert cls.__module__ == "bulletin.errors", f"{name} should be defined once, in one module"


def test_the_root_imports_nothing_but_the_standard_library() -> None:
    tree = ast.parse(Path(inspect.getfile(patcher.errors)).read_text(encoding="utf-8"))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "typing"}, imported


def test_codes_are_unique_snake_case_and_own() -> None:
    codes = [cls.code for cls in ALL.values()]
    assert len(codes) == len(set(codes)), sorted(c for c in codes if codes.count(c) > 1)
    for name, cls in ALL.items():
        assert re.fullmatch(r"[a-z][a-z0-9_]*", cls.code), name
        assert "code" in vars(cls), f"{name} inherits its parent's code"


def test_every_class_has_its_own_docstring() -> None:
    for name, cls in ALL.items():
        assert "__doc__" in vars(cls) and (cls.__doc__ or "").strip(), name


def test_builtin_mixins() -> None:
    e = bulletin.errors
    assert issubclass(e.InvalidInput, ValueError)
    assert issubclass(e.CorruptData, ValueError)
    assert issubclass(e.NotFound, KeyError)
    assert issubclass(e.StorageUnavailable, OSError)
    for kind in (e.InternalError, e.WrongBase, e.Conflict, e.EngineError):
        assert not issubclass(kind, ValueError | KeyError | OSError | RuntimeError), kind.__name__
    # KeyError quotes its argument; NotFound keeps messages readable.
    assert str(e.VersionNotFound("run: no version 3")) == "run: no version 3"


def test_the_documented_table_lists_every_class_as_it_is() -> None:
    assert set(DOCUMENTED) == set(ALL), set(DOCUMENTED) ^ set(ALL)
    for name, row in DOCUMENTED.items():
        cls = ALL[name]
        assert tuple(base.__name__ for base in cls.__bases__) == row.bases, name
        assert cls.__module__ == f"{row.defined_in}.errors", name
        assert cls.code == row.code, name


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_exit_status_as_documented(name: str) -> None:
    assert exit_status(ALL[name]("message")) == DOCUMENTED[name].exit_status


def test_a_subclass_exits_as_its_parent() -> None:
    for name, row in DOCUMENTED.items():
        for base in row.bases:
            if base in DOCUMENTED and base != "BulletinError":
                assert row.exit_status == DOCUMENTED[base].exit_status, name


def test_internal_error_is_not_mistaken_for_invalid_input() -> None:
    assert DOCUMENTED["InternalError"].exit_status not in {
        row.exit_status for row in DOCUMENTED.values() if row.kind != "InternalError"
    }


def test_the_readme_summary_agrees_with_the_table() -> None:
    text = " ".join(README.read_text(encoding="utf-8").split())
    found = re.search(r"exit status per kind \(([^;)]*)", text)
    assert found, "README.md lost its summary of exit statuses"
    summary = {
        "".join(word.capitalize() for word in words.split()): int(status)
        for status, words in re.findall(r"(\d+) ([a-z ]+?)(?:,|$)", found.group(1))
    }
    top_level = {name: row.exit_status for name, row in DOCUMENTED.items() if row.bases[0] == "BulletinError"}
    assert summary == top_level


# -- each kind where it belongs ------------------------------------------------------------


def test_a_keyframe_that_fails_its_fingerprint_is_corrupt_data_not_a_wrong_base(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    with Publisher(bucket, "run") as pub:
        pub.publish(ToyTrainer(seed=1).state)
    # Flip one bit of a tensor and make the manifest promise the new bytes: the digests
    # pass, so only the fingerprints can tell.
    keyframe = next((bucket / "run" / "keyframes").rglob("model.safetensors"))
    data = bytearray(keyframe.read_bytes())
    data[parse_safetensors_header(bytes(data), len(data), source="keyframe").data_start] ^= 1
    keyframe.chmod(0o644)
    keyframe.write_bytes(bytes(data))
    manifest_path = next((bucket / "run" / "manifests").glob("*.json"))
    document = json.loads(manifest_path.read_bytes())
    for ref in document["keyframe"]["files"]:
        ref.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    manifest_path.chmod(0o644)
    manifest_path.write_bytes(json.dumps(document).encode())
    with pytest.raises(FingerprintMismatch, match="fails its fingerprint") as info:
        Subscriber(bucket, "run", target=ArrayTarget()).sync(1)
    assert not isinstance(info.value, WrongBase)
    assert exit_status(info.value) == DOCUMENTED["CorruptData"].exit_status


def test_an_unreadable_undo_journal_is_a_format_error(tmp_path: Path) -> None:
    (tmp_path / LocalDirTarget.JOURNAL).write_text('{"format": "bulletin.journal", "spec_version": 1}')
    with pytest.raises(FormatError, match="undo journal") as info:
        LocalDirTarget(tmp_path)
    assert isinstance(info.value.__cause__, ValidationError)
    assert "\n" not in str(info.value)


def test_metadata_the_manifest_refuses_is_invalid_input(tmp_path: Path) -> None:
    with Publisher(tmp_path / "bucket", "run") as pub, pytest.raises(InvalidInput, match="metadata") as info:
        pub.publish(ToyTrainer(seed=2).state, metadata={"k" * 300: "v"})
    assert isinstance(info.value.__cause__, ValidationError)
    assert "\n" not in str(info.value)


def test_a_route_sync_never_plans_is_an_internal_error(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    trainer = ToyTrainer(seed=3)
    with Publisher(bucket, "run", keyframe_every=10) as pub:
        pub.publish(trainer.state)
        trainer.step()
        pub.publish(trainer.state)
    run = Run(open_store(bucket), "run")
    second = run.read_manifest(2)
    with pytest.raises(InternalError) as info:  # patches, but neither a held version nor a keyframe
        execute(run, SyncPlan(second, None, (second,)), ArrayTarget(), None)
    assert not isinstance(info.value, InvalidInput)
    assert exit_status(info.value) == DOCUMENTED["InternalError"].exit_status


def test_a_local_folder_for_a_run_the_schema_refuses_is_a_config_error(tmp_path: Path) -> None:
    # Refused when the target is made, not as pydantic's ValidationError at its first activation.
    with pytest.raises(ConfigError, match="invalid run name"):
        LocalDirTarget(tmp_path, run="no spaces allowed")
