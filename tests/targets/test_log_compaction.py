"""LogDirTarget's background compaction (docs/FORMAT.md 9.1): versions go on while it
copies the base, its commit keeps what was activated meanwhile, a keyframe drops it, the
overlays stay bounded, and what each change wrote is counted.

A compaction's file copies are held back where a test needs it running: the copies wait
for an event the test sets (``shutil.copyfile`` wrapped, as tests/run/crash_node.py wraps
the calls that change files)."""

from __future__ import annotations

import errno
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bulletin.checkpoint import Checkpoint
from bulletin.replica_log import LogDirTarget, WriteKind
from bulletin.target import Held, read_local_state
from schemas.local_state import LocalStateV3
from tests.targets.contract import FPS, SPECS, V, assert_bits, patch


@pytest.fixture
def held_copies(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Set it to let compactions copy the base; until then they wait."""
    release = threading.Event()
    copy = shutil.copyfile

    def held(*args: Any, **kwargs: Any) -> Any:
        assert release.wait(30), "the test never let the compaction copy"
        return copy(*args, **kwargs)

    monkeypatch.setattr(shutil, "copyfile", held)
    yield release
    release.set()


def step(target: LogDirTarget, version: int) -> None:
    assert target.apply(patch(version - 1, version), FPS[version - 1]) == FPS[version]
    target.activate(version)


def started(directory: Path, share: float) -> LogDirTarget:
    target = LogDirTarget(directory, run="r", compact_share=share)
    target.load_full(V[1], SPECS)
    target.activate(1)
    return target


def held_bits(target: LogDirTarget) -> dict[str, Any]:
    bits = target.context_bits()
    assert bits is not None
    return {name: np.array(bits[name], copy=True) for name in bits}


def assert_holds(target: LogDirTarget, version: int) -> None:
    assert target.restored() == Held(version, FPS[version])
    assert_bits(held_bits(target), V[version])


def model_folders(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.name.startswith("model-")}


def test_versions_activated_while_a_compaction_runs_stay_in_the_log_it_commits(
    tmp_path: Path, held_copies: threading.Event
) -> None:
    # Each version changes about 5% of the elements: the share is passed at version 3, and
    # version 4's apply stays under BACKLOG_FACTOR (1.5) times it (9.75% of 10.5%).
    with closing(started(tmp_path / "n", share=0.07)) as target:
        step(target, 2)
        assert not target.compacting
        step(target, 3)
        assert target.compacting  # started by the activation, which did not wait for it
        bits_before = target.context_bits()  # handed out before the commit: must stay exact
        step(target, 4)  # applied and activated while the compaction is held
        assert target.compacting and target.compactions == 0
        state = read_local_state(tmp_path / "n")
        assert isinstance(state, LocalStateV3) and [e.version for e in state.log] == [2, 3, 4]
        held_copies.set()
        assert target.wait_for_compaction(30)
        state = read_local_state(tmp_path / "n")
        assert isinstance(state, LocalStateV3)
        assert (state.base_version, state.version, [e.version for e in state.log]) == (3, 4, [4])
        assert target.compactions == 1 and target.log_entries == 1
        assert model_folders(tmp_path / "n") == {state.model_dir}  # the old base is gone
        assert sorted(os.listdir(tmp_path / "n" / "log")) == [Path(state.log[0].file).name]
        with Checkpoint(tmp_path / "n" / state.model_dir) as base:  # the new base holds version 3
            assert_bits({n: base.bits(n) for n in base.specs}, V[3])
        assert_holds(target, 4)
        assert bits_before is not None
        assert_bits({n: np.array(bits_before[n]) for n in bits_before}, V[3])  # its old base, still mapped
    with closing(LogDirTarget(tmp_path / "n", run="r")) as reopened:  # the log from base 3 replays
        assert_holds(reopened, 4)


def test_an_apply_past_the_backlog_bound_waits_for_the_compaction(tmp_path: Path, held_copies: threading.Event) -> None:
    # Share 0.04: version 2 (5%) starts a compaction; 3 fits under 1.5 times the share, 4 does not.
    with closing(started(tmp_path / "n", share=0.04)) as target:
        step(target, 2)
        assert target.compacting
        step(target, 3)
        done = threading.Event()
        failure: list[BaseException] = []

        def apply_4() -> None:
            try:
                assert target.apply(patch(3, 4), FPS[3]) == FPS[4]
            except BaseException as exc:
                failure.append(exc)
            finally:
                done.set()

        thread = threading.Thread(target=apply_4)
        thread.start()
        assert not done.wait(0.5), "the apply did not wait for the compaction"
        held_copies.set()
        assert done.wait(30) and not failure, failure
        thread.join()
        target.activate(4)
        state = read_local_state(tmp_path / "n")
        assert isinstance(state, LocalStateV3) and state.base_version == 2
        assert [e.version for e in state.log] == [3, 4]
        assert_holds(target, 4)


def test_a_keyframe_activated_meanwhile_drops_the_compaction(tmp_path: Path, held_copies: threading.Event) -> None:
    with closing(started(tmp_path / "n", share=0.04)) as target:
        step(target, 2)
        assert target.compacting
        target.load_full(V[4], SPECS)
        target.activate(4)
        held_copies.set()
        assert target.wait_for_compaction(30)
        assert target.compactions == 0 and target.last_compaction_error is None
        state = read_local_state(tmp_path / "n")
        assert isinstance(state, LocalStateV3) and (state.base_version, state.log) == (4, [])
        assert model_folders(tmp_path / "n") == {state.model_dir}  # its folder was removed
        assert os.readlink(tmp_path / "n" / "current") == state.model_dir
        assert_holds(target, 4)


def test_close_lets_a_running_compaction_commit(tmp_path: Path, held_copies: threading.Event) -> None:
    target = started(tmp_path / "n", share=0.04)
    step(target, 2)
    assert target.compacting
    threading.Timer(0.2, held_copies.set).start()
    target.close()  # waits for it
    state = read_local_state(tmp_path / "n")
    assert isinstance(state, LocalStateV3) and (state.base_version, state.version, state.log) == (2, 2, [])
    assert os.readlink(tmp_path / "n" / "current") == state.model_dir  # a loadable checkpoint again
    with Checkpoint(tmp_path / "n" / "current") as ckpt:
        assert_bits({n: ckpt.bits(n) for n in ckpt.specs}, V[2])


def test_compact_waits_for_a_background_compaction_then_compacts_the_rest(
    tmp_path: Path, held_copies: threading.Event
) -> None:
    with closing(started(tmp_path / "n", share=0.07)) as target:
        step(target, 2)
        step(target, 3)  # starts one of version 3 (4 does not wait for it: see above)
        step(target, 4)
        threading.Timer(0.2, held_copies.set).start()
        target.compact()
        assert target.compactions == 2 and target.log_entries == 0 and not target.compacting
        state = read_local_state(tmp_path / "n")
        assert isinstance(state, LocalStateV3) and (state.base_version, state.log) == (4, [])
        with Checkpoint(tmp_path / "n" / "current") as ckpt:
            assert_bits({n: ckpt.bits(n) for n in ckpt.specs}, V[4])


def test_what_each_change_wrote_is_counted_apart_from_compactions(tmp_path: Path) -> None:
    seen: list[tuple[WriteKind, int]] = []
    node = tmp_path / "n"
    with closing(LogDirTarget(node, run="r", compact_share=1.0, on_written=lambda k, n: seen.append((k, n)))) as target:
        target.load_full(V[1], SPECS)
        target.activate(1)
        base = read_local_state(node).model_dir  # type: ignore[union-attr]
        tensors = sum(p.stat().st_size for p in (node / base).glob("*.safetensors"))
        assert target.written["keyframe"] == tensors + (node / "state.json").stat().st_size
        for version in (2, 3, 4):
            before = target.written["version"]
            step(target, version)
            entry = read_local_state(node).log[-1]  # type: ignore[union-attr]
            assert target.written["version"] - before == entry.size + (node / "state.json").stat().st_size
        assert target.written["compaction"] == 0
        target.compact()
        state_size = (node / "state.json").stat().st_size
        new_base = read_local_state(node).model_dir  # type: ignore[union-attr]
        copied = sum(p.stat().st_size for p in (node / new_base).iterdir() if p.name.endswith(".safetensors"))
        assert target.written["compaction"] == copied + state_size
    assert sum(n for k, n in seen if k == "version") == target.written["version"]
    assert {k for k, _ in seen} == {"keyframe", "version", "compaction"}


def test_a_failed_compaction_changes_nothing_held_and_is_tried_again_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = shutil.copyfile
    failures = [OSError(errno.ENOSPC, "No space left on device")]

    def full_once(*args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return copy(*args, **kwargs)

    monkeypatch.setattr(shutil, "copyfile", full_once)
    with closing(started(tmp_path / "n", share=0.04)) as target:
        step(target, 2)  # starts one, which fails
        assert target.wait_for_compaction(30)
        assert target.compactions == 0 and "No space left" in (target.last_compaction_error or "")
        state = read_local_state(tmp_path / "n")
        assert isinstance(state, LocalStateV3) and (state.base_version, [e.version for e in state.log]) == (1, [2])
        assert model_folders(tmp_path / "n") == {state.model_dir}  # its folder was removed
        assert_holds(target, 2)
        step(target, 3)  # not two shares more yet: no copy per version on a failing disk
        assert not target.compacting and target.compactions == 0
        step(target, 4)
        assert target.wait_for_compaction(30) and target.compactions == 1 and target.last_compaction_error is None
        assert_holds(target, 4)
    with closing(LogDirTarget(tmp_path / "n", run="r")) as reopened:
        assert_holds(reopened, 4)


def test_without_background_the_activation_compacts(tmp_path: Path) -> None:
    with closing(LogDirTarget(tmp_path / "n", run="r", compact_share=0.04, background=False)) as target:
        target.load_full(V[1], SPECS)
        target.activate(1)
        step(target, 2)
        assert target.compactions == 1 and not target.compacting and target.log_entries == 0
