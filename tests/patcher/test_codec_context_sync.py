"""The context codec through a real run: what the publisher writes, how nodes sync it.

A local-directory store and real targets; every version a node reaches is checked bit
for bit against what the trainer served.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from bulletin import Publisher, Subscriber
from bulletin.errors import ConfigError, ContextUnavailable
from bulletin.replica_log import LogDirTarget
from bulletin.run import Run
from bulletin.storage import open_store
from bulletin.sync import execute, plan
from bulletin.target import ArrayTarget, Held, LocalDirTarget
from patcher.decode import decode, read_shard_header
from schemas.manifest import ManifestV1, ManifestV2, parse_manifest
from tests.run.helpers import ToyTrainer, assert_bits_equal


def _publish(pub: Publisher, trainer: ToyTrainer, versions: int) -> list[dict[str, NDArray[Any]]]:
    served = []
    for i in range(versions):
        if i:
            trainer.step()
        pub.publish(trainer.state)
        served.append(trainer.served())
    return served


class HiddenBits(ArrayTarget):
    """Host arrays a sync may not read as context: a target whose bits live elsewhere."""

    @property
    def supports_shards(self) -> bool:
        return False

    def context_bits(self) -> Mapping[str, NDArray[np.unsignedinteger]] | None:
        return None


def test_the_publisher_writes_the_context_codec_in_manifest_v2(tmp_path: Path) -> None:
    with Publisher(tmp_path, "run", keyframe_every=10) as pub:
        _publish(pub, ToyTrainer(), 3)
    run = Run(open_store(tmp_path), "run")
    first, second = run.read_manifest(1).manifest, run.read_manifest(2).manifest
    assert type(first) is ManifestV1 and first.patch is None  # a keyframe: nothing to say
    assert type(second) is ManifestV2 and second.spec_version == 2
    assert second.patch is not None and (second.patch.codec, second.patch.context) == ("context", "base")
    shard = run.download(second.patch.shards)[0]
    assert read_shard_header(shard).codec == "context"
    raw = (tmp_path / "run" / "manifests" / f"{2:020d}.json").read_bytes()
    assert parse_manifest(raw) == second


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_a_chosen_stream_codec_keeps_manifest_v1(tmp_path: Path, codec: str) -> None:
    with Publisher(tmp_path, "run", codec=codec) as pub:
        _publish(pub, ToyTrainer(), 2)
    manifest = Run(open_store(tmp_path), "run").read_manifest(2).manifest
    assert type(manifest) is ManifestV1 and manifest.patch is not None and manifest.patch.codec == codec


def test_an_unknown_codec_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="codec"):
        Publisher(tmp_path, "run", codec="brotli")


@pytest.mark.parametrize("target_kind", ["arrays", "folder"])
def test_nodes_sync_one_and_several_versions_at_a_time(tmp_path: Path, target_kind: str) -> None:
    store = tmp_path / "bucket"
    with Publisher(store, "run", keyframe_every=100) as pub:
        served = _publish(pub, ToyTrainer(seed=1), 6)
    target = ArrayTarget() if target_kind == "arrays" else LocalDirTarget(tmp_path / "node", run="run")
    sub = Subscriber(store, "run", target=target)
    sub.sync(1)
    sub.sync(2)  # one behind: straight from the shards (arrays) or decoded (folder)
    sub.sync(6)  # four behind: each decoded through the ones before it, folded, applied once
    held = target.arrays if isinstance(target, ArrayTarget) else target.context_bits()
    assert held is not None
    assert_bits_equal(dict(held), served[5])
    target.close()


class NoCopies(LogDirTarget):
    """A log folder that may not hand out its bits (each changed tensor would be a copy)."""

    def context_bits(self) -> Mapping[str, NDArray[np.unsignedinteger]] | None:
        raise AssertionError("a log folder's bits were copied to decode against")


@pytest.mark.parametrize("background", [False, True])
def test_a_log_folder_resolves_context_patches_through_its_overlays(tmp_path: Path, background: bool) -> None:
    # The base's map read through the overlays (and, for a route of several versions,
    # through the fold of those before): one behind, four behind, and across compactions
    # (a small share compacts after every activation, the base then moving under the log).
    store = tmp_path / "bucket"
    with Publisher(store, "run", keyframe_every=100, codec="context") as pub:
        served = _publish(pub, ToyTrainer(seed=2), 9)
    target = NoCopies(tmp_path / "node", run="run", compact_share=0.001, background=background)
    sub = Subscriber(store, "run", target=target)
    for version in (1, 2, 6, 7, 9):
        sub.sync(version)
        target.wait_for_compaction()
        assert_bits_equal(dict(LogDirTarget.context_bits(target) or {}), served[version - 1])
    target.close()


def test_a_node_that_cannot_show_its_bits_syncs_from_a_keyframe(tmp_path: Path) -> None:
    store = tmp_path / "bucket"
    with Publisher(store, "run", keyframe_every=3) as pub:
        served = _publish(pub, ToyTrainer(seed=2), 6)  # keyframes at 1 and 4
    run = Run(open_store(store), "run")
    target = HiddenBits()
    execute(run, plan(run, run.read_manifest(2), None), target, None)
    held = Held.at(run.read_manifest(2))
    # Version 3's patch would decode against bits this target does not show: the sync
    # loads the keyframe of version 1 instead and decodes 2 and 3 against its bits.
    route = plan(run, run.read_manifest(3), held)
    assert route.keyframe is None and [p.version for p in route.patches] == [3]
    report = execute(run, route, target, held)
    assert report.keyframe == 1 and report.transitions == 2
    assert_bits_equal(target.arrays, served[2])
    # Where a keyframe is on the route anyway, its bits are the context at once.
    report = execute(run, plan(run, run.read_manifest(6), Held.at(run.read_manifest(3))), target, held)
    assert report.keyframe == 4
    assert_bits_equal(target.arrays, served[5])


def test_decoding_without_the_base_is_a_typed_refusal(tmp_path: Path) -> None:
    with Publisher(tmp_path, "run") as pub:
        _publish(pub, ToyTrainer(), 2)
    run = Run(open_store(tmp_path), "run")
    manifest = run.read_manifest(2).manifest
    assert manifest.patch is not None
    shards = run.download(manifest.patch.shards)
    with pytest.raises(ContextUnavailable, match="needs the base"):
        decode(shards)


def test_a_restarted_publisher_rebuilds_through_context_patches(tmp_path: Path) -> None:
    trainer = ToyTrainer(seed=4)
    with Publisher(tmp_path, "run", keyframe_every=100) as pub:
        _publish(pub, trainer, 4)
    trainer.step()
    with Publisher(tmp_path, "run", keyframe_every=100) as pub:  # resumes from version 4's bits
        pub.publish(trainer.state)
        assert pub.version == 5
    sub = Subscriber(tmp_path, "run")
    sub.sync()
    assert_bits_equal(sub.target.arrays, trainer.served())  # type: ignore[attr-defined]


@pytest.mark.parametrize(("codec", "expected"), [(None, "context"), ("zstd", "zstd"), ("context", "context")])
def test_bulletin_publish_codec_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], codec: str | None, expected: str
) -> None:
    from bulletin.checkpoint import write_checkpoint
    from bulletin.cli import main
    from patcher.patch import TensorSpec

    rng = np.random.default_rng(0)
    spec = TensorSpec("w", "BF16", (128, 64))
    first = ((rng.standard_normal(spec.shape, dtype=np.float32) * 0.02).view(np.uint32) >> 16).astype(np.uint16)
    second = first.copy()
    second.reshape(-1)[rng.choice(first.size, 80, replace=False)] += np.uint16(1)
    store = tmp_path / "bucket"
    option = [] if codec is None else ["--codec", codec]
    for i, bits in enumerate((first, second)):
        folder = tmp_path / f"ckpt{i}"
        folder.mkdir()
        write_checkpoint(folder, {"w": spec}, {"w": bits})
        assert main(["publish", str(folder), "--store", str(store), "--run", "r", *option]) == 0
    capsys.readouterr()
    manifest = Run(open_store(store), "r").read_manifest(2).manifest
    assert manifest.patch is not None and manifest.patch.codec == expected
    assert main(["publish", str(tmp_path / "ckpt0"), "--store", str(store), "--run", "r", "--codec", "brotli"]) == 2
