"""Damage on the node's own disk is found and repaired, never patched onto.

Fingerprints are only updated incrementally by an apply, so a bit flipped in a replica's
files behind Bulletin's back would survive every later version. ``Subscriber.verify``
re-hashes the bits held against the held version; ``bulletin sync`` runs it before it
applies anything, and a mismatch is repaired from a keyframe route.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from bulletin import Publisher, Subscriber
from bulletin.checkpoint import Checkpoint, parse_safetensors_header
from bulletin.cli import main
from bulletin.maintenance import collect_garbage
from bulletin.run import Run
from bulletin.storage import open_store
from bulletin.target import ArrayTarget, LocalDirTarget
from tests.run.helpers import ToyTrainer, assert_bits_equal
from tests.run.rollback import rewrite

RUN = "run"


def _publish(store_url: str, versions: int, *, keyframe_every: int = 3, trainer: ToyTrainer | None = None) -> list:
    trainer = trainer or ToyTrainer(seed=2)
    served = []
    with Publisher(store_url, RUN, keyframe_every=keyframe_every) as pub:
        for i in range(versions):
            if i or pub.version is not None:
                trainer.step()
            pub.publish(trainer.state)
            served.append(trainer.served())
    return served


def _files(node: Path) -> dict[str, np.ndarray]:
    with Checkpoint(node / LocalDirTarget.CURRENT) as ckpt:
        return {name: np.array(ckpt.bits(name)) for name in ckpt.specs}


def flip_a_bit(node: Path, tensor: str | None = None) -> str:
    """Flip the lowest bit of one tensor's first byte in ``node/current``, as a bad disk would."""
    path = node / LocalDirTarget.CURRENT / "model.safetensors"
    data = path.read_bytes()
    header = parse_safetensors_header(data, len(data), source=str(path))
    name = tensor or max(header.offsets, key=lambda n: header.offsets[n][1] - header.offsets[n][0])
    at = header.data_start + header.offsets[name][0]
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)[0]
        fh.seek(at)
        fh.write(bytes([byte ^ 1]))
        fh.flush()
        os.fsync(fh.fileno())
    return name


def test_verify_finds_a_flipped_bit_and_repairs_it_from_a_keyframe(store_url: str, tmp_path: Path) -> None:
    served = _publish(store_url, 5)
    node = tmp_path / "node"
    with Subscriber(store_url, RUN, node) as sub:
        assert sub.sync() == 5
        clean = sub.verify()
        assert clean.ok and clean.version == 5 and clean.mismatched == () and clean.repaired_to is None
        name = flip_a_bit(node)
        report = sub.verify()
        assert not report.ok and report.version == 5 and report.mismatched == (name,)
        assert report.repaired_to == 5 and report.repair_error is None
        last = sub.stats.last_report
        assert last is not None and last.keyframe == 4 and last.transitions == 1  # a keyframe route
        assert sub.current_version == 5
        assert (sub.stats.verifications, sub.stats.damaged, sub.stats.repairs) == (2, 1, 1)
        assert sub.stats.last_verify == report
        assert sub.verify().ok
    assert_bits_equal(_files(node), served[4])


def test_damaged_bits_are_never_a_patch_base(store_url: str, tmp_path: Path) -> None:
    # Damage an element no later patch touches: an apply's incremental fingerprints would
    # carry it forward for ever. Found first, the next sync starts from a keyframe.
    trainer = ToyTrainer(seed=2)
    _publish(store_url, 2, keyframe_every=100, trainer=trainer)
    node = tmp_path / "node"
    with Subscriber(store_url, RUN, node) as sub:
        assert sub.sync() == 2
    name = flip_a_bit(node, "model.norm.weight")  # norm weights never change in ToyTrainer
    served = _publish(store_url, 2, keyframe_every=100, trainer=trainer)
    with Subscriber(store_url, RUN, node) as sub:
        report = sub.verify(repair=False)
        assert not report.ok and report.mismatched == (name,) and report.repaired_to is None
        assert sub.current_version is None  # untrusted until repaired
        assert sub.sync() == 4
        last = sub.stats.last_report
        assert last is not None and last.keyframe == 1 and last.transitions == 3
        assert sub.verify().ok
    assert_bits_equal(_files(node), served[-1])


def test_an_in_memory_target_is_verified_and_repaired_too(store_url: str) -> None:
    served = _publish(store_url, 3)
    target = ArrayTarget()
    sub = Subscriber(store_url, RUN, target=target)
    assert sub.sync() == 3
    target.arrays["model.layers.0.mlp.up_proj.weight"].reshape(-1)[7] ^= 1
    report = sub.verify()
    assert report.mismatched == ("model.layers.0.mlp.up_proj.weight",) and report.repaired_to == 3
    assert_bits_equal(target.arrays, served[2])


def test_a_garbage_collected_version_is_repaired_to_the_newest(store_url: str, tmp_path: Path) -> None:
    served = _publish(store_url, 3)
    node = tmp_path / "node"
    with Subscriber(store_url, RUN, node) as sub:
        assert sub.sync(2) == 2
        flip_a_bit(node)
        served += _publish(store_url, 4)
        collect_garbage(Run(open_store(store_url), RUN), keep=1)
        assert sub.verify().repaired_to == 7
    assert_bits_equal(_files(node), served[-1])


def test_a_repair_obeys_the_chain_check(store_url: str, tmp_path: Path) -> None:
    _publish(store_url, 3)
    node = tmp_path / "node"
    with Subscriber(store_url, RUN, node) as sub:
        assert sub.sync() == 3
        flip_a_bit(node)
        rewrite(store_url, RUN, 3, seed=77)
        report = sub.verify()  # a repair must not switch chains silently
        assert not report.ok and report.repaired_to is None and report.repair_error_code == "chain_mismatch"
        assert sub.current_version is None
    with Subscriber(store_url, RUN, node, allow_reset=True) as sub:
        assert sub.verify().repaired_to == 3
        assert sub.verify().ok


def test_bulletin_sync_verifies_first_and_repairs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bucket = str(tmp_path / "bucket")
    served = _publish(bucket, 4)
    node = tmp_path / "node"
    where = ["--store", bucket, "--run", RUN, "--to", str(node)]
    assert main(["sync", *where]) == 0
    capsys.readouterr()
    status = ["status", "--store", bucket, "--run", RUN, "--local", str(node), "--verify"]
    assert main([*status, "--json"]) == 0
    checked = json.loads(capsys.readouterr().out)["local_verify"]
    assert checked["ok"] is True and checked["version"] == 4
    name = flip_a_bit(node)
    assert main(status) == 6
    assert "DAMAGED" in capsys.readouterr().out

    assert main(["sync", *where, "--json"]) == 0  # already at the newest version: repaired all the same
    data = json.loads(capsys.readouterr().out)
    assert data["repaired"] is True and data["version"] == 4 and data["keyframe"] == 4
    assert data["verified"]["ok"] is False and data["verified"]["mismatched"] == [name]
    assert_bits_equal(_files(node), served[3])
    assert main(status) == 0
    assert "bits intact" in capsys.readouterr().out

    flip_a_bit(node)
    assert main(["sync", *where]) == 0
    assert "repaired: the bits held for version 4 did not match" in capsys.readouterr().out
    assert_bits_equal(_files(node), served[3])


def test_bulletin_sync_no_verify_skips_the_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bucket = str(tmp_path / "bucket")
    _publish(bucket, 2)
    node = tmp_path / "node"
    where = ["--store", bucket, "--run", RUN, "--to", str(node)]
    assert main(["sync", *where]) == 0
    flip_a_bit(node)
    capsys.readouterr()
    assert main(["sync", *where, "--no-verify", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["verified"] is None and data["repaired"] is False


def test_a_flipped_bit_does_not_survive_the_next_sync(tmp_path: Path) -> None:
    # Before verification, the damaged element rode along every later version.
    bucket = str(tmp_path / "bucket")
    trainer = ToyTrainer(seed=4)
    _publish(bucket, 2, keyframe_every=100, trainer=trainer)
    node = tmp_path / "node"
    where = ["--store", bucket, "--run", RUN, "--to", str(node)]
    assert main(["sync", *where]) == 0
    flip_a_bit(node, "model.norm.weight")
    served = _publish(bucket, 3, keyframe_every=100, trainer=trainer)
    assert main(["sync", *where]) == 0
    assert_bits_equal(_files(node), served[-1])
