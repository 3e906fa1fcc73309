"""A replica folder's failures are typed, one line, and leave the held version intact.

The disk's refusals are injected where they happen, in this process: the calls that
write (``open`` in ``bulletin.fileio``, ``os.replace``, ``os.mkdir``, ``os.symlink``,
``os.fsync``) raise the ``OSError`` a full disk (ENOSPC), a read-only mount (EROFS) or
a denied permission (EACCES, EPERM) raises. That is fault injection, not a mocked
component: everything else is the real code on a real folder. (The tests run as root,
where ``chmod`` denies nothing, so permission is injected too; a chmod test runs where
it can.)
"""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import bulletin.fileio
import bulletin.target
from bulletin import Publisher, Subscriber
from bulletin.checkpoint import Checkpoint, write_checkpoint
from bulletin.cli import main
from bulletin.cli.output import exit_status
from bulletin.errors import (
    DiskFull,
    FormatError,
    LocalStorageError,
    OutOfMemory,
    PermissionDenied,
    ReadOnlyStorage,
)
from bulletin.target import LocalDirTarget
from patcher.fingerprint import fingerprint
from patcher.patch import TensorSpec
from tests.run.helpers import ToyTrainer

KINDS: dict[int, type[LocalStorageError]] = {
    errno.ENOSPC: DiskFull,
    errno.EDQUOT: DiskFull,
    errno.EROFS: ReadOnlyStorage,
    errno.EACCES: PermissionDenied,
    errno.EPERM: PermissionDenied,
    errno.EIO: LocalStorageError,
}
CODES = {DiskFull: "disk_full", ReadOnlyStorage: "read_only_storage", PermissionDenied: "permission_denied"}


@pytest.fixture(scope="module")
def run_url(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, dict[str, int]]]:
    """Versions 1..3: keyframe 1, patches 2 and 3."""
    url = str(tmp_path_factory.mktemp("bucket"))
    trainer = ToyTrainer(seed=51, shapes={"w": (64, 48), "b": (48,)})
    expected = {}
    with Publisher(url, "run", keyframe_every=100) as pub:
        for version in (1, 2, 3):
            if version > 1:
                trainer.step(lr=1e-2)
            pub.publish(trainer.state)
            expected[version] = {n: fingerprint(b) for n, b in trainer.served().items()}
    return url, expected


#: route: (version held before, None for an empty folder; version asked for)
ROUTES: dict[str, tuple[int | None, int]] = {
    "fresh": (None, 1),  # a keyframe into an empty folder
    "catch-up": (1, 3),  # patches in place, under the undo journal
    "downgrade": (3, 1),  # a keyframe over a held version
}


class Fault:
    """Makes the ``nth`` matching call of one kind raise ``OSError(code)``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, where: str, code: int, match: str = "") -> None:
        self.code, self.match, self.hits = code, match, 0
        if where == "open":  # the writes of bulletin.fileio (keyframe files, journal, state)
            real_open = open

            def fake_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
                fh = real_open(file, mode, *args, **kwargs)
                if "w" in mode and self._hit(file):
                    fh.close()  # the file was created: what is left behind is the test's point
                    self._raise(file)
                return fh

            monkeypatch.setattr(bulletin.fileio, "open", fake_open, raising=False)
            return
        where = where.removeprefix("os.")  # "os.open": the descriptor-level open
        real = getattr(os, where)

        def fake(*args: Any, **kwargs: Any) -> Any:
            if self._hit(args[-1] if where in ("replace", "symlink") else args[0]):
                self._raise(args[0])
            return real(*args, **kwargs)

        monkeypatch.setattr(os, where, fake)

    def _hit(self, path: Any) -> bool:
        if self.match not in str(path):
            return False
        self.hits += 1
        return self.hits == 1

    def _raise(self, path: Any) -> None:
        raise OSError(self.code, os.strerror(self.code), str(path))


def sync_cli(url: str, node: Path, version: int, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["sync", "--store", url, "--run", "run", "--to", str(node), "--version", str(version)])
    _, err = capsys.readouterr()
    return code, err


def prepare(url: str, node: Path, held: int | None) -> None:
    if held is not None:
        with Subscriber(url, "run", node) as sub:
            assert sub.sync(held) == held


def assert_holds(node: Path, expected: dict[int, dict[str, int]], version: int | None) -> None:
    """Exactly ``version`` (None: nothing), and nothing else in the folder."""
    held = LocalDirTarget.peek(node, run="run")
    if version is None:
        assert held is None
        assert set(os.listdir(node)) <= {LocalDirTarget.LOCK}, sorted(os.listdir(node))
        return
    assert held is not None and held.version == version and held.fingerprints == expected[version]
    state = bulletin.target.read_local_state(node)
    assert state is not None
    with Checkpoint(node / LocalDirTarget.CURRENT) as ckpt:
        assert {n: fingerprint(ckpt.bits(n)) for n in ckpt.specs} == expected[version]
    assert os.readlink(node / LocalDirTarget.CURRENT) == state.model_dir
    left = set(os.listdir(node)) - {LocalDirTarget.STATE, LocalDirTarget.CURRENT, LocalDirTarget.LOCK, state.model_dir}
    assert not left, f"left behind: {sorted(left)}"
    assert sorted(os.listdir(node / state.model_dir)) == [LocalDirTarget.MARKER, "model.safetensors"]


#: (call, file-name fragment it must touch, routes where that call happens)
FAULTS: list[tuple[str, str, tuple[str, ...]]] = [
    ("os.open", ".model.safetensors.tmp-", ("fresh", "downgrade")),  # streaming the keyframe in (its temp file)
    ("open", "journal.npz", ("catch-up",)),  # the undo data
    ("open", "journal.json", ("catch-up",)),  # the journal, after the undo data
    ("open", "state.json", ("fresh", "catch-up", "downgrade")),  # the new state, at activation
    ("replace", "", ("fresh", "catch-up", "downgrade")),  # the first rename of the route
    ("replace", "state.json", ("fresh", "catch-up", "downgrade")),  # the commit point itself
    ("mkdir", "model-", ("fresh", "downgrade")),  # the keyframe's folder
    ("symlink", "", ("fresh", "catch-up", "downgrade")),  # staging the `current` link
    ("fsync", "", ("fresh", "catch-up", "downgrade")),  # the first fsync
]
CASES = [
    pytest.param(route, where, match, code, id=f"{route}-{where}:{match or 'first'}-{errno.errorcode[code]}")
    for where, match, routes in FAULTS
    for route in routes
    for code in (errno.ENOSPC, errno.EROFS, errno.EACCES)
] + [
    pytest.param("catch-up", "open", "journal.npz", errno.EPERM, id="catch-up-open:journal.npz-EPERM"),
    pytest.param("fresh", "os.open", ".model.safetensors.tmp-", errno.EDQUOT, id="fresh-os.open:model-EDQUOT"),
    pytest.param("downgrade", "replace", "", errno.EIO, id="downgrade-replace-EIO"),
]


@pytest.mark.parametrize(("route", "where", "match", "code"), CASES)
def test_a_refusing_disk_is_a_typed_one_line_error_and_the_held_version_stays(
    run_url: tuple[str, dict[int, dict[str, int]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    route: str,
    where: str,
    match: str,
    code: int,
) -> None:
    url, expected = run_url
    held, wanted = ROUTES[route]
    node = tmp_path / "node"
    prepare(url, node, held)
    with monkeypatch.context() as patched:
        fault = Fault(patched, where, code, match)
        status, err = sync_cli(url, node, wanted, capsys)
    assert fault.hits >= 1, "the fault was never reached"
    kind = KINDS[code]
    assert status == 11 == exit_status(kind("x")), err
    assert err.count("\n") == 1 and err.startswith(f"error: {kind.code}: "), err
    assert errno.errorcode[code] in err
    assert_holds(node, expected, held)
    # Nothing is stuck: without the fault the same sync goes through.
    assert sync_cli(url, node, wanted, capsys)[0] == 0
    assert_holds(node, expected, wanted)


def test_the_library_raises_the_kind_with_errno_and_cause(
    run_url: tuple[str, dict[int, dict[str, int]]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, expected = run_url
    node = tmp_path / "node"
    prepare(url, node, 1)
    with Subscriber(url, "run", node) as sub, monkeypatch.context() as patched:
        Fault(patched, "open", errno.ENOSPC, "journal.npz")
        with pytest.raises(DiskFull) as info:
            sub.sync(3)
        assert sub.current_version == 1
    assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
    assert isinstance(info.value.__cause__, OSError) and not isinstance(info.value.__cause__, DiskFull)
    assert_holds(node, expected, 1)


def test_a_failure_after_the_commit_is_logged_and_the_next_open_repairs_it(
    run_url: tuple[str, dict[int, dict[str, int]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url, expected = run_url
    node = tmp_path / "node"
    prepare(url, node, 3)
    with Subscriber(url, "run", node) as sub, monkeypatch.context() as patched, caplog.at_level(logging.WARNING):
        Fault(patched, "replace", errno.EIO, "current")  # switching `current`, after state.json
        assert sub.sync(1) == 1  # committed: the version is 1, whatever the link says
        assert "version 1 is committed" in caplog.text
    state = bulletin.target.read_local_state(node)
    assert state is not None and state.version == 1
    assert os.readlink(node / LocalDirTarget.CURRENT) != state.model_dir  # still the old folder
    with Subscriber(url, "run", node) as sub:  # the next open (a no-op sync) repairs the pair
        assert sub.sync(1) == 1
    assert_holds(node, expected, 1)


def _raise_memory_error(*args: Any, **kwargs: Any) -> Any:
    raise MemoryError


@pytest.mark.parametrize(
    ("route", "what"),
    [("catch-up", "apply_patch"), ("fresh", "Checkpoint"), ("downgrade", "Checkpoint")],
)
def test_out_of_memory_is_a_typed_one_line_error_and_the_held_version_stays(
    run_url: tuple[str, dict[int, dict[str, int]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    route: str,
    what: str,
) -> None:
    url, expected = run_url
    held, wanted = ROUTES[route]
    node = tmp_path / "node"
    prepare(url, node, held)
    with monkeypatch.context() as patched:
        patched.setattr(bulletin.target, what, _raise_memory_error)
        status, err = sync_cli(url, node, wanted, capsys)
    assert status == 12 == exit_status(OutOfMemory("x")) == exit_status(MemoryError())
    assert err.count("\n") == 1 and err.startswith("error: out_of_memory: out of memory"), err
    assert_holds(node, expected, held)


def test_write_checkpoint_removes_what_it_wrote_when_the_disk_fills(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    specs = {f"t{i}": TensorSpec(f"t{i}", "BF16", (256,)) for i in range(4)}
    tensors = {name: np.arange(256, dtype=np.uint16) for name in specs}
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "mine.txt").write_text("not Bulletin's")
    with monkeypatch.context() as patched:
        fault = Fault(patched, "open", errno.ENOSPC, "00003-of")
        with pytest.raises(DiskFull, match="No space left on device"):
            write_checkpoint(out, specs, tensors, max_shard_bytes=512)
    assert fault.hits == 1
    assert sorted(os.listdir(out)) == ["mine.txt"]  # the two files written before it are gone too


def test_an_unreadable_undo_file_is_a_format_error(tmp_path: Path) -> None:
    trainer = ToyTrainer(seed=52)
    url = str(tmp_path / "bucket")
    with Publisher(url, "run") as pub:
        pub.publish(trainer.state)
    node = tmp_path / "node"
    prepare(url, node, 1)
    state = bulletin.target.read_local_state(node)
    assert state is not None
    journal = {"format": "bulletin.journal", "spec_version": 1, "model_dir": state.model_dir, "from_version": 1}
    (node / LocalDirTarget.JOURNAL).write_text(json.dumps(journal))
    (node / LocalDirTarget.UNDO).write_bytes(b"PK\x03\x04 torn")
    with pytest.raises(FormatError, match="unreadable undo data") as info:
        LocalDirTarget(node, run="run")
    assert "\n" not in str(info.value)
    # The failed open released the lock: the next one fails the same way, not as ReplicaBusy.
    (node / LocalDirTarget.JOURNAL).write_text(json.dumps(journal)[:40])  # a torn journal too
    with pytest.raises(FormatError, match="undo journal"):
        LocalDirTarget(node, run="run")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file modes: permission is injected above instead")
def test_a_folder_without_write_permission_is_permission_denied(
    run_url: tuple[str, dict[int, dict[str, int]]], tmp_path: Path
) -> None:
    url, _ = run_url
    node = tmp_path / "node"
    node.mkdir()
    node.chmod(0o555)
    try:
        with pytest.raises(PermissionDenied):
            Subscriber(url, "run", node)
    finally:
        node.chmod(0o755)


# -- nothing but what it created ------------------------------------------------------------


@pytest.fixture
def strangers(tmp_path: Path) -> Iterator[Callable[[], None]]:
    """Folders and files in the replica folder that Bulletin did not create."""
    node = tmp_path / "node"
    made = {
        "model-mine/weights.bin": b"mine",
        "model-0123456789ab/notes.txt": b"named like Bulletin's, not marked",
        "model-notes.txt": b"a file",
        ".state.json.backup": b"mine too",
    }
    for name, data in made.items():
        (node / name).parent.mkdir(parents=True, exist_ok=True)
        (node / name).write_bytes(data)

    def check() -> None:
        for name, data in made.items():
            assert (node / name).read_bytes() == data, f"{name} was touched"

    yield check


def test_sync_to_never_deletes_what_it_did_not_create(
    run_url: tuple[str, dict[int, dict[str, int]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    strangers: Callable[[], None],
) -> None:
    url, expected = run_url
    node = tmp_path / "node"
    with monkeypatch.context() as patched:  # a failing sync (the disk fills at activation)
        Fault(patched, "open", errno.ENOSPC, "state.json")
        assert sync_cli(url, node, 1, capsys)[0] == 11
    strangers()
    assert sync_cli(url, node, 99, capsys)[0] == 3  # no such version
    strangers()
    for version in (1, 3, 1):  # keyframe, catch-up, a keyframe over it (the old folder goes)
        assert sync_cli(url, node, version, capsys)[0] == 0
        strangers()
    held = LocalDirTarget.peek(node)
    assert held is not None and held.fingerprints == expected[1]
    models = sorted(p.name for p in node.iterdir() if p.name.startswith("model-"))
    assert len(models) == 4  # the three strangers and the one folder state.json names


def test_log_of_a_local_store_that_does_not_exist_is_not_found(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-such-store"
    for command in ("log", "verify", "gc"):
        extra = ["--keep", "1"] if command == "gc" else []
        code = main([command, "--store", str(missing), "--run", "run", *extra])
        _, err = capsys.readouterr()
        assert code == 3, (command, err)
        assert err.count("\n") == 1 and err.startswith("error: not_found: no store at "), err
    assert not missing.exists()
    missing.mkdir()  # an existing, empty store: an empty chain
    assert main(["log", "--store", str(missing), "--run", "run"]) == 0
