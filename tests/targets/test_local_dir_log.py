"""LogDirTarget (a base folder plus a patch log, docs/FORMAT.md 9.1) against the contract,
and what only the log layout does: appends per version, compaction, verified replay."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from contextlib import closing
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from numpy.typing import NDArray

from bulletin.checkpoint import Checkpoint
from bulletin.errors import ConfigError, FormatError, InvalidInput
from bulletin.replica_log import LOG_MAGIC, LogDirTarget, decode_log, encode_log, open_replica
from bulletin.target import Held, LocalDirTarget, WeightTarget, read_local_state
from schemas.local_state import LocalStateV3
from tests.targets.contract import FPS, SPECS, TargetContract, V, assert_bits, patch


class TestLogDirTarget(TargetContract):
    durable: ClassVar[bool] = True

    @pytest.fixture
    def target(self, tmp_path: Path) -> Iterator[WeightTarget]:
        target = LogDirTarget(tmp_path / "local", run="r")
        yield target
        target.close()

    def held_bits(self, target: WeightTarget) -> Mapping[str, NDArray[Any]]:
        bits = target.context_bits()
        assert bits is not None
        return {name: np.array(bits[name], copy=True) for name in bits}

    def reopen(self, target: WeightTarget) -> WeightTarget:
        assert isinstance(target, LogDirTarget)
        target.close()
        return LogDirTarget(target.dir, run="r")


def at(target: LocalDirTarget, version: int) -> None:
    target.load_full(V[1], SPECS)
    target.activate(1)
    for v in range(2, version + 1):
        assert target.apply(patch(v - 1, v), FPS[v - 1]) == FPS[v]
        target.activate(v)


def test_versions_append_to_the_log_and_never_touch_the_base(tmp_path: Path) -> None:
    with closing(LogDirTarget(tmp_path / "n", run="r", compact_share=1.0)) as target:
        at(target, 1)
        base = target.dir / target._state.model_dir  # type: ignore[union-attr]
        before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in base.iterdir()}
        assert os.readlink(target.dir / "current") == base.name  # the base is exactly version 1
        for v in (2, 3, 4):
            target.apply(patch(v - 1, v), FPS[v - 1])
            target.activate(v)
        state = read_local_state(target.dir)
        assert isinstance(state, LocalStateV3) and (state.base_version, state.version) == (1, 4)
        assert [e.version for e in state.log] == [2, 3, 4]
        assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in base.iterdir()} == before
        assert not os.path.lexists(target.dir / "current")  # not a loadable checkpoint now
        assert target.model_path is None
        with pytest.raises(InvalidInput, match="compact"):
            _ = target.staged_path
    reopened = LogDirTarget(tmp_path / "n", run="r")
    assert reopened.restored() == Held(4, FPS[4])
    assert_bits(TestLogDirTarget().held_bits(reopened), V[4])
    reopened.close()


def test_compaction_makes_a_loadable_current_of_the_version(tmp_path: Path) -> None:
    with closing(LogDirTarget(tmp_path / "n", run="r", compact_share=1.0)) as target:
        at(target, 3)
        old_base = target._state.model_dir  # type: ignore[union-attr]
        target.compact()
        state = read_local_state(target.dir)
        assert isinstance(state, LocalStateV3) and state.log == [] and state.base_version == 3
        assert not (target.dir / old_base).exists() and list((target.dir / "log").iterdir()) == []
        with Checkpoint(target.dir / "current") as ckpt:
            assert_bits({n: ckpt.bits(n) for n in ckpt.specs}, V[3])
        assert target.compactions == 1


def test_the_overlay_share_triggers_compaction(tmp_path: Path) -> None:
    with closing(LogDirTarget(tmp_path / "n", run="r", compact_share=0.06)) as target:
        at(target, 4)  # each version changes about 5% of the elements
        assert target.wait_for_compaction(30) and target.compactions >= 1
        assert target.restored() == Held(4, FPS[4])
        assert_bits(TestLogDirTarget().held_bits(target), V[4])


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_a_damaged_log_is_never_reported(tmp_path: Path, damage: str) -> None:
    with closing(LogDirTarget(tmp_path / "n", run="r", compact_share=1.0)) as target:
        at(target, 3)
        entry = read_local_state(target.dir).log[-1]  # type: ignore[union-attr]
    path = tmp_path / "n" / entry.file
    if damage == "remove":
        path.unlink()
    else:
        data = bytearray(path.read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 1
        else:
            del data[-3:]
        path.write_bytes(bytes(data))
    with closing(LogDirTarget(tmp_path / "n", run="r")) as target:
        assert target.restored() is None  # a keyframe route rebuilds it
        target.load_full(V[4], SPECS)
        target.activate(4)
        assert target.restored() == Held(4, FPS[4])


def test_a_dense_folder_becomes_the_base_and_a_log_folder_refuses_dense(tmp_path: Path) -> None:
    with closing(LocalDirTarget(tmp_path / "n", run="r")) as dense:
        at(dense, 2)
    with closing(open_replica(tmp_path / "n", run="r", layout="log")) as target:
        assert target.restored() == Held(2, FPS[2])
        target.apply(patch(2, 3), FPS[2])
        target.activate(3)
    with pytest.raises(ConfigError, match="log layout"):
        LocalDirTarget(tmp_path / "n", run="r")
    with pytest.raises(ConfigError, match="layout"):
        open_replica(tmp_path / "n", run="r", layout="sparse")  # type: ignore[arg-type]


def test_log_files_are_exactly_what_encode_log_writes() -> None:
    data = encode_log(patch(1, 2))
    assert data.startswith(LOG_MAGIC)
    decoded = decode_log(data, SPECS, source="t")
    assert {td.spec.name: (td.indices.tolist(), td.delta.tolist()) for td in decoded} == {
        td.spec.name: (td.indices.tolist(), td.delta.tolist()) for td in patch(1, 2)
    }
    for bad in (data[:-1], data + b"\0", b"XXXXXXXX" + data[8:], data[:12]):
        with pytest.raises(FormatError):
            decode_log(bad, SPECS, source="t")


def test_state_v3_is_consistent() -> None:
    with pytest.raises(FormatError):
        from schemas.local_state import parse_local_state

        doc = {
            "format": "bulletin.local-state",
            "spec_version": 3,
            "run": "r",
            "version": 2,
            "model_dir": "model-000000000000",
            "fingerprints": {},
            "updated_at": "2026-12-01T00:00:00Z",
            "layout": "log",
            "base_version": 3,
            "base_fingerprints": {},
            "log": [],
        }
        parse_local_state(json.dumps(doc).encode(), source="t")


def test_bulletin_sync_layout_log_appends_and_materializes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bulletin.publisher import Publisher
    from patcher.fingerprint import fingerprint
    from tests.cli.test_cli import run
    from tests.run.helpers import ToyTrainer

    store = str(tmp_path / "bucket")
    trainer = ToyTrainer(seed=3, shapes={"w": (64, 32), "b": (32,)})
    served = {}
    with Publisher(store, "r", keyframe_every=100) as pub:
        for v in (1, 2, 3):
            if v > 1:
                trainer.step(lr=1e-3)
            assert pub.publish(trainer.state) == v
            served[v] = {n: fingerprint(b) for n, b in trainer.served().items()}
    node = tmp_path / "node"
    common = ["--store", store, "--run", "r", "--to", str(node), "--json"]
    code, out, _ = run(capsys, "sync", *common, "--layout", "log", "--version", "1")
    assert code == 0 and json.loads(out)["path"] == str(node / "current"), out
    code, out, _ = run(capsys, "sync", *common, "--layout", "log", "--version", "2")
    assert code == 0 and json.loads(out)["version"] == 2, out
    assert isinstance(read_local_state(node), LocalStateV3)  # (compacted: many elements changed)
    code, out, _ = run(capsys, "sync", *common, "--version", "3")  # the dense layout refuses it
    assert code != 0 and "log layout" in out, out
    code, out, _ = run(capsys, "sync", *common, "--layout", "log", "--materialize")
    assert code == 0 and json.loads(out)["version"] == 3 and json.loads(out)["path"] == str(node / "current")
    with Checkpoint(node / "current") as ckpt:
        assert {n: fingerprint(ckpt.bits(n)) for n in ckpt.specs} == served[3]
    code, out, _ = run(capsys, "sync", *common, "--materialize")
    assert code != 0, out
